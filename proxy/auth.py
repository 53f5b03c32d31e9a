"""Client keys: who may use infertap (and so, indirectly, the upstream keys it holds)."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from proxy.settings import AuthSettings, ConfigError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ClientKeys:
    """SHA-256 digests of the accepted keys; a presented key is hashed and compared in constant time."""

    def __init__(self, digests: list[bytes]) -> None:
        self.digests = digests

    @classmethod
    def from_settings(cls, auth: AuthSettings) -> ClientKeys | None:
        digests: list[bytes] = []
        if auth.keys_env:
            value = os.environ.get(auth.keys_env, "")
            keys = [k.strip() for k in value.split(",") if k.strip()]
            if not keys:
                raise ConfigError(f"auth.keys_env names ${auth.keys_env}, which is not set or empty")
            digests += [_digest(k) for k in keys]
        if auth.keys_file:
            digests += _read_hashes(Path(auth.keys_file))
        return cls(digests) if digests else None

    def check(self, authorization: str | None) -> bool:
        if not authorization or not authorization.startswith("Bearer "):
            return False
        key = authorization[7:].strip()
        if not key:
            return False
        presented = _digest(key)
        ok = False
        for d in self.digests:  # no early exit: the time taken says nothing about which key matched
            ok |= hmac.compare_digest(d, presented)
        return ok


def _read_hashes(path: Path) -> list[bytes]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"auth.keys_file {path} cannot be read: {e.strerror}") from None
    out: list[bytes] = []
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ConfigError(
                f"auth.keys_file {path}:{n}: expected a hex SHA-256 hash (64 hex digits); "
                'make one with: printf %s "$KEY" | sha256sum'
            )
        out.append(raw)
    if not out:
        raise ConfigError(f"auth.keys_file {path} holds no hashes")
    return out


def bearer_token(env: str | None) -> str | None:
    """The token that /metrics requires, from the environment variable `env` names."""
    if not env:
        return None
    token = os.environ.get(env)
    if not token:
        raise ConfigError(f"auth.metrics_token_env names ${env}, which is not set or empty")
    return token
