"""The demo's external agents: a tokens file and port for the agent API, and the example agents' command lines.

``fleetrl demo --config recipes/demo-agent.yaml`` starts ``agent.demo_agents`` processes of
examples/calculator_agent.py against the coordinator's agent API; together they open exactly the run's groups.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import yaml

from launcher.redis_server import free_port
from protos.config import RunConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def prepare_agents(config: RunConfig, out_dir: Path) -> str:
    """Fix the agent API's port and, unless the run names a tokens file, write one (one demo token, mode 600)
    into the run directory; returns the token the demo's agents use ('' = theirs come from FLEETRL_TOKEN)."""
    agent = config.agent
    if not agent.port:
        agent.port = free_port(agent.host)  # the agents are told it before the coordinator is up
    if agent.tokens_file or os.environ.get("FLEETRL_TOKENS_FILE"):
        return os.environ.get("FLEETRL_TOKEN", "")
    token = secrets.token_urlsafe(24)
    path = out_dir / "agent-tokens.yaml"
    grant = {"name": "demo-agents", "token": token, "scopes": ["generate", "submit", "admin"], "rate_per_s": 1000}
    path.write_text(yaml.safe_dump({"tokens": [grant]}))
    path.chmod(0o600)
    agent.tokens_file = str(path)
    return token


def demo_agent_commands(config: RunConfig, token: str) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, python argv, env) of each demo agent; each takes whole groups, together the run's total."""
    agent, group_size = config.agent, config.coordinator.group_size
    count = agent.demo_agents
    groups = config.num_steps * config.groups_per_step
    commands = []
    for i in range(count):
        share = groups // count + (i < groups % count)
        args = [
            str(EXAMPLES / "calculator_agent.py"),
            "--address",
            f"{agent.host}:{agent.port}",
            "--token-env",
            "FLEETRL_TOKEN",
            "--sessions",
            str(share * group_size),
            "--group-size",
            str(group_size),
            "--concurrency",
            str(2 * group_size),
            "--seed",
            str(i),
        ]
        commands.append((f"agent-{i}", args, {"FLEETRL_TOKEN": token, "PYTHONPATH": str(EXAMPLES.parent)}))
    return commands
