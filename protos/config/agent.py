"""The agent API's section: where it listens, who may call it, how sessions and their groups behave.

The agent API is served by the coordinator (it owns admission, the fleet and the queue); see docs/agents.md.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from protos.config.base import Strict


class AgentConfig(Strict):
    """External agents: sessions over gRPC (protos/agent.proto) and the OpenAI-compatible HTTP door."""

    enabled: bool = Field(False, description="Serve the agent API from the coordinator.")
    host: str = Field("127.0.0.1", description="Interface of the agent gRPC server (0.0.0.0 for other hosts).")
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Agent gRPC port; 0 = a free one, kept for the run in Redis (coordinator/kept_port.py).",
    )
    openai_port: int = Field(-1, ge=-1, le=65535, description="OpenAI-compatible HTTP port; -1 = off, 0 = free one.")
    only_agents: bool = Field(
        False,
        description="The coordinator draws no prompts of its own: it only admits, records and queues agents' "
        "sessions (a run fed by agents alone).",
    )
    demo_agents: int = Field(
        0, ge=0, description="fleetrl demo starts this many example agents (examples/calculator_agent.py) against it."
    )
    tokens_file: str = Field(
        "",
        description="YAML file of bearer tokens (name, token or token_sha256, scopes, rate_per_s); '' = the "
        "FLEETRL_TOKENS_FILE environment variable. Never commit it. With no file the agent API refuses to start.",
    )
    tls_cert_file: str = Field("", description="PEM server certificate; with tls_key_file the API speaks TLS.")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file.")
    session_timeout_s: float = Field(
        300.0, gt=0, description="A session idle this long is abandoned (its group slot goes to another session)."
    )
    group_timeout_s: float = Field(
        900.0,
        gt=0,
        description="A group not complete this long after it was admitted is dropped and its slot re-used "
        "(groups are queued in slot order, so an incomplete group would hold every later one).",
    )
    max_sessions: int = Field(4096, gt=0, description="Open sessions at most; more are refused RESOURCE_EXHAUSTED.")
    admission_retry_ms: int = Field(
        500, gt=0, description="Retry delay sent with RESOURCE_EXHAUSTED when the staleness budget is spent."
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> AgentConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("agent.tls_cert_file and agent.tls_key_file go together (both or neither)")
        return self
