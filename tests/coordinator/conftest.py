"""Fixtures of the coordinator's tests: a self-signed TLS pair (auth and the agent API over TLS), and one rollout
server process (vLLM CPU, the tiny model) shared by the modules of the agent API's and the door's tests."""

from __future__ import annotations

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from modeling.tiny_model import init_tiny
from tests.rollout_service.server_process import spawn_rollout_server, stop_process


@pytest.fixture
def tls_pair(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key (PEM files); the cert is its own CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "server.crt", tmp_path / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_file), str(key_file)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny model (seed 0: the same weights wherever it is built), written once and only read."""
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


_shared_servers: list = []  # the session's rollout server process, while it runs


@pytest.fixture(scope="session")
def rollout_server(tiny_model, tmp_path_factory):
    """One rollout server process (``server-id r0``) shared by every module that asks for it; stopped (killed if it
    must) after the last test that uses it (``pytest_runtest_teardown``), not left idle for the rest of the session.
    Shared, not one per module (each start is ~25 s on 2 cores): it is given no Redis, so it follows no weight
    announcements and serves the tiny model's v0 weights from start to end, and no test stops, pauses or updates it;
    the tests only send it requests."""
    server = spawn_rollout_server(tiny_model, tmp_path_factory.mktemp("logs") / "rollout.log", "--server-id", "r0")
    _shared_servers.append(server.process)
    try:
        yield server.wait_serving(timeout_s=300)
    finally:
        stop_process(server.process)
        _shared_servers.clear()


def pytest_runtest_teardown(item, nextitem):
    """Stops the shared rollout server once no test after ``item`` in this session uses it."""
    if not _shared_servers or "rollout_server" not in item.fixturenames:
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    if not any("rollout_server" in getattr(other, "fixturenames", ()) for other in later):
        stop_process(_shared_servers.pop())


@pytest.fixture
def tiny_tokenizer():
    """The tiny model's tokenizer (built locally, no download)."""
    from modeling.tiny_model import build_tokenizer

    return build_tokenizer()
