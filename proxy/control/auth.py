"""Client keys: who may use infertap (and so, indirectly, the upstream keys it holds), and who they are.

A key may carry a name (`SHA256HEX NAME` in the keys file, `NAME=KEY` in the environment): the
name, never the key or its hash, is the request's `client` label, log field and span attribute.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

from proxy.observe.metrics.labels import BoundedLabels, multiprocess_dir
from proxy.settings import AuthSettings, ClientSettings, ConfigError

ANONYMOUS = "anonymous"  # no client keys configured and no trusted header
UNNAMED = "unnamed"  # a key configured without a name
OTHER = "other"  # past the cap of names taken from the trusted header, or not a valid name
NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")
_RESERVED = frozenset({ANONYMOUS, UNNAMED, OTHER})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _check_name(name: str, where: str) -> str:
    if not NAME.fullmatch(name) or name in _RESERVED:
        raise ConfigError(
            f"{where}: client name {name[:70]!r} must be 1-64 of A-Z a-z 0-9 _ . : @ - "
            f"and not one of {', '.join(sorted(_RESERVED))}"
        )
    return name


class ClientKeys:
    """SHA-256 digests of the accepted keys; a presented key is hashed and compared in constant time."""

    def __init__(self, digests: list[bytes], names: list[str] | None = None) -> None:
        self.digests = digests
        self.names = names if names is not None else [UNNAMED] * len(digests)

    @classmethod
    def from_settings(cls, auth: AuthSettings) -> ClientKeys | None:
        digests: list[bytes] = []
        names: list[str] = []
        if auth.keys_env:
            value = os.environ.get(auth.keys_env, "")
            entries = [k.strip() for k in value.split(",") if k.strip()]
            if not entries:
                raise ConfigError(f"auth.keys_env names ${auth.keys_env}, which is not set or empty")
            for entry in entries:
                name, key = _split_env_entry(entry, f"${auth.keys_env}")
                digests.append(_digest(key))
                names.append(name)
        if auth.keys_file:
            for digest, name in _read_hashes(Path(auth.keys_file)):
                digests.append(digest)
                names.append(name)
        return cls(digests, names) if digests else None

    def identify(self, authorization: str | None) -> str | None:
        """The client name of the presented key (UNNAMED for a key without one), None if refused."""
        key = bearer_key(authorization)
        if key is None:
            return None
        presented = _digest(key)
        found = -1
        for i, d in enumerate(self.digests):  # no early exit: the time says nothing about which matched
            if hmac.compare_digest(d, presented):
                found = i
        return self.names[found] if found >= 0 else None


def bearer_key(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None when there is none. The scheme's
    name is case-insensitive (RFC 7235: `bearer`, `BEARER` alike), and one or more spaces follow it."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether the header presents `token` (the metrics or admin token), compared in constant time."""
    key = bearer_key(authorization)
    return key is not None and hmac.compare_digest(key.encode(), token.encode())


def _split_env_entry(entry: str, where: str) -> tuple[str, str]:
    """`NAME=KEY` or a bare KEY. A bare key may end in `=` padding; one with `=` inside needs a name."""
    name, sep, key = entry.partition("=")
    if sep and key.strip("=") and NAME.fullmatch(name):
        return _check_name(name, where), key
    return UNNAMED, entry


def _read_hashes(path: Path) -> list[tuple[bytes, str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"auth.keys_file {path} cannot be read: {e.strerror}") from None
    out: list[tuple[bytes, str]] = []
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        digest, _, name = text.partition(" ")
        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ConfigError(
                f"auth.keys_file {path}:{n}: expected a hex SHA-256 hash (64 hex digits), optionally "
                'followed by a client name; make one with: printf %s "$KEY" | sha256sum'
            )
        name = name.strip()
        out.append((raw, _check_name(name, f"auth.keys_file {path}:{n}") if name else UNNAMED))
    if not out:
        raise ConfigError(f"auth.keys_file {path} holds no hashes")
    return out


class HeaderNames(BoundedLabels):
    """Client names from a trusted header, bounded like the `model` label (across workers too): the
    first `cap` valid names are kept, anything later or malformed is OTHER."""

    def __init__(self, header: str, cap: int, shared_dir: str | None = None) -> None:
        super().__init__(cap, shared_dir, "infertap_client_labels.txt", missing=ANONYMOUS)
        self.header = header.lower().encode("latin-1")

    def accepts(self, name: str) -> bool:
        return NAME.fullmatch(name) is not None and name not in _RESERVED


def header_names(clients: ClientSettings, keys: ClientKeys | None) -> HeaderNames | None:
    """The trusted-header resolver; none when client keys name the clients, or no header is set."""
    if keys is not None or not clients.header:
        return None
    return HeaderNames(clients.header, clients.max_clients, multiprocess_dir())


def bearer_token(env: str | None, setting: str = "auth.metrics_token_env") -> str | None:
    """The token that /metrics (or, by `setting`, another route) requires, from the environment
    variable `env` names."""
    if not env:
        return None
    token = os.environ.get(env)
    if not token:
        raise ConfigError(f"{setting} names ${env}, which is not set or empty")
    return token
