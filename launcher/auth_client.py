"""The client side of the coordinator's bearer tokens and TLS (docs/auth.md): what the admin CLI sends.

The server side (token file, scopes, rate limits, interceptors) is ``coordinator/auth.py``; the two meet only on
the wire: an ``authorization: Bearer <token>`` header and a TLS certificate the client trusts.
"""

from __future__ import annotations

from pathlib import Path

import grpc

__all__ = ["call_metadata", "channel_credentials"]


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``token`` (none for an empty token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_credentials(ca_file: str) -> grpc.ChannelCredentials:
    """TLS trusting the PEM certificate(s) in ``ca_file`` (the server's CA, or a self-signed cert)."""
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
