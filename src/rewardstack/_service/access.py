"""Who may call the scoring service: bearer tokens, the namespace each may use, and loopback.

A tokens file is a TOML table mapping the SHA-256 hex digest of a bearer token to the one namespace
it may use. `REWARDSTACK_TOKEN` (environment) is a token that may use every namespace. Presented
tokens are hashed and compared against every configured hash with `hmac.compare_digest`, with no
early exit, so the time taken says nothing about which hash came close. With no token configured
the service binds loopback only (`is_loopback`); the edge (service/edge.py) asks `Access` on each
request (`authorize`) and guards a loopback service without tokens from browsers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rewardstack.errors import ConfigError
from rewardstack._service.namespaces import NAME_RE, valid_name

TOKEN_ENV = "REWARDSTACK_TOKEN"
ALL_NAMESPACES = "*"
MIN_TOKEN_CHARS = 16
"""Shortest `REWARDSTACK_TOKEN` accepted: a shorter one can be guessed by trying (the tokens file
holds digests, whose tokens cannot be measured; its owner makes them)."""


def token_hash(token: str) -> str:
    """The SHA-256 hex digest of a token: what a tokens file stores, never the token itself."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def is_loopback(host: str) -> bool:
    """Whether binding `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Access:
    """Who may call the service: unbound tokens (any namespace) and tokens bound to one namespace."""

    hashes: dict[str, str]
    """Token SHA-256 hex digest -> namespace (ALL_NAMESPACES for the environment's token)."""

    @property
    def required(self) -> bool:
        """Whether requests must carry a bearer token (some token is configured)."""
        return bool(self.hashes)

    def namespace_of(self, token: str | None) -> str | None:
        """The namespace `token` may use (ALL_NAMESPACES for any), or None if it is not valid."""
        if token is None:
            return None
        presented = token_hash(token).encode()
        found: str | None = None
        for digest, namespace in self.hashes.items():
            # Every hash is compared, match or not: no early exit.
            if hmac.compare_digest(presented, digest.encode()) and found is None:
                found = namespace
        return found

    @classmethod
    def load(cls, tokens_file: str | None, *, environ: dict[str, str] | None = None) -> "Access":
        """Tokens from `REWARDSTACK_TOKEN` and the tokens file (never from the command line)."""
        env = os.environ if environ is None else environ
        hashes: dict[str, str] = {}
        token = env.get(TOKEN_ENV)
        if token:
            if len(token) < MIN_TOKEN_CHARS:
                raise ConfigError(f"${TOKEN_ENV}", f"the token is {len(token)} character(s) long; a token needs at "
                                  f"least {MIN_TOKEN_CHARS} characters (make one with: python -c 'import secrets; "
                                  "print(secrets.token_urlsafe(32))')")
            hashes[token_hash(token)] = ALL_NAMESPACES
        if tokens_file:
            path = Path(tokens_file)
            try:
                table = tomllib.loads(path.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ConfigError("service.tokens_file", f"cannot read {path}: {e}") from e
            for digest, namespace in table.items():
                if not re.fullmatch(r"[0-9a-f]{64}", digest):
                    raise ConfigError("service.tokens_file", f"key {digest!r} is not a SHA-256 hex digest of a token")
                if not valid_name(namespace):
                    raise ConfigError("service.tokens_file", f"namespace {namespace!r} of a token must match {NAME_RE.pattern}")
                hashes[digest] = namespace
        return cls(hashes)
