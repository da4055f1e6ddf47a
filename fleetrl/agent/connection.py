"""What every call of a client carries: the bearer token metadata, and the channel's TLS credentials."""

from __future__ import annotations

from pathlib import Path

import grpc


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The ``authorization: Bearer <token>`` metadata every agent API call carries."""
    if not token:
        raise ValueError("the agent API token is empty: pass the token the run's tokens_file grants you")
    return (("authorization", f"Bearer {token}"),)


def channel_credentials(tls_ca_file: str | Path | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the PEM bundle ``tls_ca_file``; None (plaintext) when no file is given."""
    if tls_ca_file is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes())


CHANNEL_OPTIONS = [
    # Large enough for a finished chunk carrying routed experts of a long session.
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    # A restarted coordinator serves its sessions again (docs/agents.md): reconnect within seconds, not grpc's
    # default of up to two minutes, so that the retries of RetryPolicy find it.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
