"""An upstream's settings: where it is, which models it serves, its key's variable, its overrides."""

from __future__ import annotations

import os
import re
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.settings.sections import TAOTOKEN_HOST, RetrySettings, TimeoutSettings, _Section

# RFC 9110 token characters, and an optional trailing `*` for a prefix.
_HEADER_PATTERN = re.compile(r"[a-z0-9!#$%&'+.^_`|~-]*[a-z0-9!#$%&'+.^_`|~-]\*?|\*")
_CREDENTIALS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "api-key",
        "x-api-key",
        "cookie",
        "set-cookie",
        "www-authenticate",
    }
)


class UpstreamSettings(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    base_url: str = Field(default="", description="the OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    replicas: list[str] = Field(
        default_factory=list,
        description="a pool instead of base_url: the replicas' base URLs, or one "
        "dns://NAME:PORT/PATH entry re-resolved every discovery_interval_seconds (docs/fleet.md)",
    )
    balance: Literal["least_request", "round_robin", "prefix_affinity"] = Field(
        default="least_request", description="how a pool's replica is chosen per request"
    )
    balance_load_factor: float = Field(
        default=0.25,
        gt=0,
        le=10,
        description="prefix_affinity: a replica carries at most (1 + this) x the pool's mean load",
    )
    session_header: str = Field(
        default="x-session-id", description="prefix_affinity: the client header naming a conversation"
    )
    discovery_interval_seconds: float = Field(default=5.0, gt=0, le=3600)
    api_key_env: str | None = Field(default=None, description="NAME of the env variable holding the key")
    models: list[str] = Field(default_factory=list, description="glob patterns routed here; first match wins")
    default: bool = False
    headers: dict[str, str] = Field(default_factory=dict)
    fallback: list[str] = Field(
        default_factory=list, description="upstreams to try, in order, when this one's attempts fail"
    )
    forward_headers: list[str] = Field(
        default_factory=list,
        description="client headers to forward beyond the default allow-list (names, or `prefix-*`), "
        "e.g. openai-organization; credentials and hop-by-hop headers never pass",
    )
    return_headers: list[str] = Field(
        default_factory=list,
        description="answer headers to return to clients beyond the default allow-list (names, or "
        "`prefix-*`); credentials and cookies never pass",
    )
    timeouts: dict[str, float | None] = Field(default_factory=dict, description="overrides [timeouts]")
    retry: dict[str, float] = Field(default_factory=dict, description="overrides [retry]")
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="requests in flight to this upstream at most (its own connection pool; default "
        "1000); more wait up to [timeouts] pool, then fail with pool_timeout",
    )

    # Each override is checked here, with the rest of the file, by the section's own model: the
    # same bounds as [timeouts] and [retry], and an error that names the field
    # (upstreams.0.timeouts.ttft), rather than when the server builds its routing.
    @field_validator("timeouts")
    @classmethod
    def _known_timeouts(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        unknown = set(v) - set(TimeoutSettings.model_fields) - {"read"}
        if unknown:
            raise ValueError(
                f"unknown timeout(s) {sorted(unknown)}; known: {sorted(TimeoutSettings.model_fields)}"
            )
        if "read" in v and "idle" in v:
            raise ValueError("give idle or read (its other name), not both")
        TimeoutSettings.model_validate(v)
        return v

    @field_validator("retry")
    @classmethod
    def _known_retry(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = set(v) - set(RetrySettings.model_fields)
        if unknown:
            raise ValueError(
                f"unknown retry setting(s) {sorted(unknown)}; known: {sorted(RetrySettings.model_fields)}"
            )
        RetrySettings.model_validate(v)
        return v

    def effective_timeouts(self, base: TimeoutSettings) -> TimeoutSettings:
        overrides = {("idle" if k == "read" else k): v for k, v in self.timeouts.items()}
        return TimeoutSettings.model_validate({**base.model_dump(), **overrides})

    def effective_retry(self, base: RetrySettings) -> RetrySettings:
        return RetrySettings.model_validate({**base.model_dump(), **self.retry})

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        return v and _http_url(v)

    @field_validator("replicas")
    @classmethod
    def _check_replicas(cls, v: list[str]) -> list[str]:
        if any(r.startswith("dns") and "://" in r for r in v):
            if len(v) != 1:
                raise ValueError(
                    "a dns:// entry discovers the whole pool: give it alone, or list every replica's URL"
                )
            dns_target(v[0])
            return v
        out = [_http_url(r) for r in v]
        if len(set(out)) != len(out):
            raise ValueError("a replica is listed twice: list each base URL once")
        return out

    @field_validator("session_header")
    @classmethod
    def _session_header(cls, v: str) -> str:
        name = v.strip().lower()
        if not _HEADER_PATTERN.fullmatch(name) or name.endswith("*"):
            raise ValueError(f"{v!r} is not a header name")
        return name

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if self.base_url and self.replicas:
            raise ValueError("give base_url (one server) or replicas (a pool), not both")
        if not self.base_url and not self.replicas:
            raise ValueError(
                "give base_url (e.g. http://127.0.0.1:8000/v1) or replicas (a list of base URLs, "
                "or one dns://NAME:PORT/v1)"
            )
        return self

    def urls(self) -> list[str]:
        """The configured base URL(s): one, or the pool's static list (none for a dns:// pool)."""
        if self.base_url:
            return [self.base_url]
        return [] if self.dns() else list(self.replicas)

    def dns(self) -> DnsTarget | None:
        """A dns:// pool's target; None for a base_url or a list."""
        return (
            dns_target(self.replicas[0])
            if len(self.replicas) == 1 and self.replicas[0].startswith("dns://")
            else None
        )

    @field_validator("headers")
    @classmethod
    def _no_credentials(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if name.lower() in ("authorization", "api-key", "x-api-key"):
                raise ValueError(f"header {name!r} carries a credential: use api_key_env instead")
        return v

    @field_validator("forward_headers", "return_headers")
    @classmethod
    def _header_patterns(cls, v: list[str]) -> list[str]:
        out = []
        for p in v:
            name = p.strip().lower()
            if not _HEADER_PATTERN.fullmatch(name):
                raise ValueError(f"{p!r} is not a header name (or a `prefix-*` pattern)")
            if name in _CREDENTIALS:
                raise ValueError(f"{p!r} carries a credential: it never crosses infertap")
            out.append(name)
        return out

    @model_validator(mode="after")
    def _one_credential(self) -> Self:
        # Both would be sent, and the HTTP client refuses to combine them: every request a 500.
        if self.api_key_env and any(urlsplit(u).username is not None for u in self.urls()):
            raise ValueError(
                "base_url carries credentials (user:password@) and api_key_env is set: use one of them"
            )
        return self

    @model_validator(mode="after")
    def _taotoken_key(self) -> Self:
        # TaoToken's one documented key variable, so `--upstream https://taotoken.net/api` just works.
        if self.api_key_env is None and any(urlsplit(u).hostname == TAOTOKEN_HOST for u in self.urls()):
            self.api_key_env = "TAOTOKEN_API_KEY"
        return self

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        return os.environ.get(self.api_key_env) or None


def _http_url(v: str) -> str:
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
    return v.rstrip("/")


class DnsTarget(tuple[str, int, str]):
    """(name, port, path) of a `dns://NAME:PORT/PATH` pool."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return self[0]

    @property
    def port(self) -> int:
        return self[1]

    @property
    def path(self) -> str:
        return self[2]

    def replica_url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{self.port}{self.path}"


def dns_target(entry: str) -> DnsTarget:
    """Checks a `dns://NAME:PORT/PATH` entry; each address it resolves to is `http://IP:PORT/PATH`."""
    parts = urlsplit(entry)
    if parts.scheme != "dns":
        raise ValueError(
            f"{entry!r}: discovery is plain http to each address (dns://NAME:PORT/PATH); for https, "
            "list the replicas' https:// URLs (a certificate names a host, not a pod's address)"
        )
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.username or parts.query:
        raise ValueError(
            f"{entry!r} is not dns://NAME:PORT/PATH, e.g. dns://vllm.llm.svc.cluster.local:8000/v1"
        )
    return DnsTarget((parts.hostname, port, parts.path.rstrip("/")))
