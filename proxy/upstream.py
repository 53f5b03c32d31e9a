"""Upstreams: the routing table (model -> upstream), the shared HTTP client, and how failures are named."""

from __future__ import annotations

import fnmatch
import random
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

from proxy.settings import RetrySettings, Settings, TimeoutSettings, UpstreamSettings


class ErrorKind(StrEnum):
    """Why an upstream attempt failed. The values double as `outcome` labels and JSON error types."""

    CONNECT_TIMEOUT = "connect_timeout"
    CONNECT_ERROR = "connect_error"
    TTFT_TIMEOUT = "ttft_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    READ_ERROR = "stream_interrupted"
    PROTOCOL_ERROR = "protocol_error"
    UPSTREAM_429 = "rate_limited"
    UPSTREAM_5XX = "upstream_error"


# Most specific first: httpx's exception classes form a hierarchy.
_EXCEPTION_KINDS: tuple[tuple[type[Exception], ErrorKind], ...] = (
    (httpx.ConnectTimeout, ErrorKind.CONNECT_TIMEOUT),
    (httpx.PoolTimeout, ErrorKind.CONNECT_TIMEOUT),
    (httpx.ReadTimeout, ErrorKind.IDLE_TIMEOUT),
    (httpx.WriteTimeout, ErrorKind.IDLE_TIMEOUT),
    (httpx.ConnectError, ErrorKind.CONNECT_ERROR),
    (httpx.RemoteProtocolError, ErrorKind.READ_ERROR),
    (httpx.ReadError, ErrorKind.READ_ERROR),
    (httpx.WriteError, ErrorKind.CONNECT_ERROR),
    (httpx.ProtocolError, ErrorKind.PROTOCOL_ERROR),
    (httpx.TimeoutException, ErrorKind.IDLE_TIMEOUT),
    (httpx.TransportError, ErrorKind.CONNECT_ERROR),
)


def classify(exc: Exception) -> ErrorKind:
    for exc_type, kind in _EXCEPTION_KINDS:
        if isinstance(exc, exc_type):
            return kind
    return ErrorKind.PROTOCOL_ERROR


def describe(exc: Exception) -> str:
    """A short, key-free description of a transport failure."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int
    backoff_seconds: float
    max_backoff_seconds: float

    @classmethod
    def from_settings(cls, s: RetrySettings) -> RetryPolicy:
        return cls(s.max_attempts, s.backoff_seconds, s.max_backoff_seconds)

    def backoff(self, attempt: int) -> float:
        """Exponential with full jitter around the base: attempt 1 -> ~base, 2 -> ~2*base, ..."""
        base = self.backoff_seconds * (2 ** (attempt - 1))
        return float(min(self.max_backoff_seconds, base * random.uniform(0.5, 1.0)))


@dataclass(slots=True)
class Upstream:
    name: str
    base_url: str
    models: list[str]
    headers: dict[str, str]
    api_key_env: str | None
    api_key: str | None = field(repr=False)

    @classmethod
    def from_settings(cls, s: UpstreamSettings) -> Upstream:
        return cls(s.name, s.base_url, list(s.models), dict(s.headers), s.api_key_env, s.api_key())

    def url(self, suffix: str) -> str:
        """`suffix` is the path after /v1, e.g. `/chat/completions`."""
        return self.base_url + suffix

    def matches(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


class Router:
    """First upstream whose `models` patterns match wins; the default one catches the rest."""

    def __init__(self, upstreams: list[Upstream], default: Upstream) -> None:
        self.upstreams = upstreams
        self.default = default

    @classmethod
    def from_settings(cls, settings: Settings) -> Router:
        ups = [Upstream.from_settings(u) for u in settings.upstreams]
        if not ups:
            raise ValueError("no upstream configured")
        flagged = [u for u, s in zip(ups, settings.upstreams, strict=True) if s.default]
        return cls(ups, flagged[0] if flagged else ups[0])

    def route(self, model: str | None) -> Upstream:
        if model:
            for up in self.upstreams:
                if up.models and up.matches(model):
                    return up
        return self.default

    def by_name(self, name: str) -> Upstream | None:
        return next((u for u in self.upstreams if u.name == name), None)


def make_client(timeouts: TimeoutSettings, max_connections: int = 1000) -> httpx.AsyncClient:
    """One pooled client for all upstreams; no env proxies (a stray HTTP_PROXY would buffer streams)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=timeouts.connect, read=timeouts.read, write=timeouts.write, pool=timeouts.pool
        ),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        trust_env=False,
        follow_redirects=False,
    )
