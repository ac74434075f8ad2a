"""Tokens, namespaces' names and what counts as loopback (no server needed)."""

from __future__ import annotations

import hashlib

import pytest

from rewardstack.errors import ConfigError
from rewardstack._service.access import ALL_NAMESPACES, Access, is_loopback, token_hash
from rewardstack._service.namespaces import valid_name


def test_tokens_from_the_environment_and_a_file_of_digests(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "tokens.toml"
    f.write_text(f'"{hashlib.sha256(b"tok-a").hexdigest()}" = "validator-a"\n')
    access = Access.load(str(f), environ={"REWARDSTACK_TOKEN": "admin-token-16ch"})
    assert access.required
    assert access.namespace_of("admin-token-16ch") == ALL_NAMESPACES
    assert access.namespace_of("tok-a") == "validator-a"
    assert access.namespace_of("tok-b") is None and access.namespace_of(None) is None
    assert access.namespace_of(token_hash("tok-a")) is None  # the digest itself is not a token
    assert not Access.load(None, environ={}).required


@pytest.mark.parametrize("content, problem", [
    ('"tok-a" = "validator-a"\n', "SHA-256"),
    (f'"{"0" * 64}" = "../up"\n', "namespace"),
    ("not toml = = \n", "cannot read"),
])
def test_a_bad_tokens_file_is_a_config_error(tmp_path, content: str, problem: str) -> None:  # noqa: ANN001
    f = tmp_path / "tokens.toml"
    f.write_text(content)
    with pytest.raises(ConfigError, match=problem):
        Access.load(str(f), environ={})


def test_names_and_loopback() -> None:
    assert valid_name("validator_A-1") and valid_name("x" * 64)
    assert not any(valid_name(n) for n in ("", "x" * 65, "../a", "a/b", "a b", ".", None, 3))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.org")


@pytest.mark.parametrize("token", ["x", "fifteen-chars15"])
def test_a_token_shorter_than_16_characters_is_refused_at_start(token: str) -> None:
    """Issue 33 #10: a one-character REWARDSTACK_TOKEN was accepted."""
    with pytest.raises(ConfigError, match="at least 16 characters"):
        Access.load(None, environ={"REWARDSTACK_TOKEN": token})
