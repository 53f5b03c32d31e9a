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
    (httpx.ProtocolError, ErrorKind.UPSTREAM_5XX),
    (httpx.TimeoutException, ErrorKind.IDLE_TIMEOUT),
    (httpx.TransportError, ErrorKind.CONNECT_ERROR),
)


def classify(exc: Exception) -> ErrorKind:
    for exc_type, kind in _EXCEPTION_KINDS:
        if isinstance(exc, exc_type):
            return kind
    return ErrorKind.UPSTREAM_5XX


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


class Breaker:
    """Consecutive-failure circuit breaker: open for a cool-down, then one probe request decides."""

    __slots__ = ("threshold", "cooldown", "failures", "open_until", "probing")

    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.failures = 0
        self.open_until = 0.0
        self.probing = False

    @property
    def is_open(self) -> bool:
        return self.open_until > 0.0

    def allow(self, now: float) -> bool:
        if self.open_until == 0.0:
            return True
        if now < self.open_until or self.probing:
            return False
        self.probing = True  # half-open: this request is the probe
        return True

    def success(self) -> bool:
        """Returns True when this closes an open circuit."""
        was_open = self.is_open
        self.failures = 0
        self.open_until = 0.0
        self.probing = False
        return was_open

    def failure(self, now: float) -> bool:
        """Returns True when this opens a closed circuit."""
        self.failures += 1
        if self.probing or self.failures >= self.threshold:
            was_open = self.is_open
            self.open_until = now + self.cooldown
            self.probing = False
            return not was_open
        return False


@dataclass(slots=True)
class Upstream:
    name: str
    base_url: str
    models: list[str]
    headers: dict[str, str]
    api_key_env: str | None
    api_key: str | None = field(repr=False)
    timeout: httpx.Timeout
    ttft_timeout: float
    total_timeout: float | None
    retry: RetryPolicy
    breaker: Breaker
    fallback: list[str] = field(default_factory=list)

    @classmethod
    def from_settings(cls, s: UpstreamSettings, settings: Settings) -> Upstream:
        t = s.effective_timeouts(settings.timeouts)
        return cls(
            s.name,
            s.base_url,
            list(s.models),
            dict(s.headers),
            s.api_key_env,
            s.api_key(),
            httpx.Timeout(connect=t.connect, read=t.idle, write=t.write, pool=t.pool),
            t.ttft,
            t.total,
            RetryPolicy.from_settings(s.effective_retry(settings.retry)),
            Breaker(settings.circuit.failure_threshold, settings.circuit.cooldown_seconds),
            list(s.fallback),
        )

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
        self._by_name = {u.name: u for u in upstreams}

    @classmethod
    def from_settings(cls, settings: Settings) -> Router:
        ups = [Upstream.from_settings(u, settings) for u in settings.upstreams]
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

    def plan(self, first: Upstream) -> list[Upstream]:
        """The routed upstream, then its fallbacks, in order."""
        return [first, *(self._by_name[name] for name in first.fallback)]

    def by_name(self, name: str) -> Upstream | None:
        return self._by_name.get(name)


def make_client(timeouts: TimeoutSettings, max_connections: int = 1000) -> httpx.AsyncClient:
    """One pooled client for all upstreams; no env proxies (a stray HTTP_PROXY would buffer streams).

    Each request passes its upstream's own timeouts; these are the defaults for anything else.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=timeouts.connect, read=timeouts.idle, write=timeouts.write, pool=timeouts.pool
        ),
        # Expire idle connections before a typical server's 5 s keep-alive closes them under us.
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=4.0
        ),
        trust_env=False,
        follow_redirects=False,
    )
