"""The token file, the token book and the rate limiter of coordinator.auth, in-process (no servers)."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from coordinator.auth import (
    Authenticator,
    Refused,
    Scope,
    TokenBook,
    TokenFileError,
    bearer_token,
    configured_token_book,
)
from launcher.auth_client import call_metadata
from protos.config.agent import AgentConfig

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def write(tmp_path, text: str) -> str:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    return str(path)


def test_a_plain_token_and_a_sha256_token_both_load_and_are_found(tmp_path):
    digest = hashlib.sha256(b"secret-b").hexdigest()
    path = write(
        tmp_path,
        f"""tokens:
  - {{name: team-a, token: secret-a, scopes: [generate, submit], rate_per_s: 20, burst: 40}}
  - {{name: ops, token_sha256: {digest.upper()}, scopes: [admin], rate_per_s: 0.5}}
""",
    )
    book = TokenBook.load(path)
    a, ops = book.find("secret-a"), book.find("secret-b")
    assert a is not None and a.name == "team-a" and a.scopes == {Scope.GENERATE, Scope.SUBMIT}
    assert (a.rate_per_s, a.burst) == (20.0, 40.0)
    assert ops is not None and ops.scopes == {Scope.ADMIN} and ops.burst == 1.0  # burst defaults to max(1, rate)
    assert book.find("secret-c") is None
    assert "secret" not in repr(a)  # the digest stays out of logs too


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{name: a, scopes: [generate], rate_per_s: 1}", "tokens[0] (a): token: give exactly one of token or"),
        ("{name: a, token: x, token_sha256: ab, scopes: [generate], rate_per_s: 1}", "tokens[0] (a): token: give"),
        ("{name: a, token_sha256: abc, scopes: [generate], rate_per_s: 1}", "tokens[0] (a): token_sha256: 64 hex"),
        ("{name: a, token: 'x y', scopes: [generate], rate_per_s: 1}", "tokens[0] (a): token: a non-empty string"),
        ("{name: a, token: x, scopes: [generate, train], rate_per_s: 1}", "(a): scopes: unknown scope 'train'"),
        ("{name: a, token: x, scopes: [], rate_per_s: 1}", "tokens[0] (a): scopes: required"),
        ("{name: a, token: x, scopes: [admin]}", "tokens[0] (a): rate_per_s: required, a number > 0"),
        ("{name: a, token: x, scopes: [admin], rate_per_s: -2}", "(a): rate_per_s: required, a number > 0 (calls"),
        ("{name: a, token: x, scopes: [admin], rate_per_s: fast}", "(a): rate_per_s: required, a number > 0"),
        ("{name: a, token: x, scopes: [admin], rate_per_s: 1, burst: 0.5}", "tokens[0] (a): burst: at least 1"),
        ("{name: a, token: x, scopes: [admin], rate_per_s: 1, rate: 2}", "tokens[0] (a): rate: unknown field"),
        ("{token: x, scopes: [admin], rate_per_s: 1}", "tokens[0]: name: required"),
        ("just-a-string", "tokens[0]: expected a mapping"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_entry_and_the_field(tmp_path, entry, message):
    path = write(tmp_path, f"tokens:\n  - {entry}\n")
    with pytest.raises(TokenFileError) as error:
        TokenBook.load(path)
    assert f"token file {path}: " in str(error.value) and message in str(error.value)


def test_duplicate_names_and_duplicate_tokens_are_refused(tmp_path):
    grant = "{name: %s, token: %s, scopes: [admin], rate_per_s: 1}"
    path = write(tmp_path, f"tokens:\n  - {grant % ('a', 'x')}\n  - {grant % ('a', 'y')}\n")
    with pytest.raises(TokenFileError, match=r"tokens\[1\] \(a\): name: duplicate name 'a'"):
        TokenBook.load(path)
    digest = hashlib.sha256(b"x").hexdigest()
    other = f"{{name: b, token_sha256: {digest}, scopes: [admin], rate_per_s: 1}}"
    path = write(tmp_path, f"tokens:\n  - {grant % ('a', 'x')}\n  - {other}\n")
    with pytest.raises(TokenFileError, match=r"tokens\[1\] \(b\): token: the same token as 'a'"):
        TokenBook.load(path)


def test_unreadable_or_malformed_files_are_clear_errors_that_quote_no_token(tmp_path):
    with pytest.raises(TokenFileError, match="cannot read it"):
        TokenBook.load(tmp_path / "missing.yaml")
    with pytest.raises(TokenFileError, match="expected one key 'tokens'"):
        TokenBook.load(write(tmp_path, "grants: []\n"))
    with pytest.raises(TokenFileError, match="not valid YAML at line 2, column 1") as error:
        TokenBook.load(write(tmp_path, "tokens: [{name: a, token: hunter2-secret, scopes: [admin]\n"))
    assert "hunter2" not in str(error.value)


def test_the_file_comes_from_the_config_else_the_environment(tmp_path, monkeypatch):
    path = write(tmp_path, "tokens:\n  - {name: a, token: x, scopes: [admin], rate_per_s: 1}\n")
    monkeypatch.delenv("FLEETRL_TOKENS_FILE", raising=False)
    assert configured_token_book(AgentConfig()) is None
    assert configured_token_book(AgentConfig(tokens_file=path)).grants[0].name == "a"
    monkeypatch.setenv("FLEETRL_TOKENS_FILE", path)
    assert configured_token_book(AgentConfig()).grants[0].name == "a"


def test_the_bearer_header_is_parsed_strictly_and_never_echoed():
    assert bearer_token(call_metadata("tok-1")) == "tok-1"
    assert bearer_token((("authorization", b"bearer tok-1"),)) == "tok-1"
    for metadata, message in [
        ((), "no authorization metadata"),
        ((("authorization", "Basic tok-1"),), "malformed authorization metadata"),
        ((("authorization", "Bearer"),), "malformed authorization metadata"),
        ((("authorization", "Bearer tok-1"), ("authorization", "Bearer tok-2")), "malformed"),
    ]:
        with pytest.raises(Refused) as error:
            bearer_token(metadata)
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED and message in error.value.message
        assert "tok-" not in error.value.message


def test_the_rate_limit_allows_a_burst_then_refills_at_the_rate(tmp_path):
    book = TokenBook.load(
        write(tmp_path, "tokens:\n  - {name: a, token: x, scopes: [generate], rate_per_s: 4, burst: 2}\n")
    )
    clock = Clock()
    auth = Authenticator(book, clock=clock)
    metadata = call_metadata("x")
    assert auth.authorize(metadata, Scope.GENERATE).name == "a"
    assert auth.authorize(metadata, Scope.GENERATE).name == "a"
    with pytest.raises(Refused) as error:
        auth.authorize(metadata, Scope.GENERATE)
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.value.retry_after_ms == 250
    clock.now += 0.125  # half a call refilled: still refused, for the other half
    with pytest.raises(Refused) as error:
        auth.authorize(metadata, Scope.GENERATE)
    assert error.value.retry_after_ms == 125 and "retry after 125 ms" in error.value.message
    clock.now += 0.125
    assert auth.authorize(metadata, Scope.GENERATE).name == "a"
    clock.now += 60  # refills to the burst, no further
    for _ in range(2):
        auth.authorize(metadata, Scope.GENERATE)
    with pytest.raises(Refused):
        auth.authorize(metadata, Scope.GENERATE)


def test_a_missing_scope_is_refused_before_the_rate_limit_is_spent(tmp_path):
    book = TokenBook.load(write(tmp_path, "tokens:\n  - {name: a, token: x, scopes: [generate], rate_per_s: 1}\n"))
    auth = Authenticator(book, clock=Clock())
    with pytest.raises(Refused) as error:
        auth.authorize(call_metadata("x"), Scope.ADMIN)
    assert (
        error.value.code == grpc.StatusCode.PERMISSION_DENIED and error.value.message == "token 'a' lacks scope 'admin'"
    )
    assert auth.authorize(call_metadata("x"), Scope.GENERATE).name == "a"  # the one call of its burst is still there
