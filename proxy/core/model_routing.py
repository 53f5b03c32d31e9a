"""Model routing: which upstream (and which fallbacks) serve a model, with each upstream's retry policy
and circuit breaker."""

from __future__ import annotations

import fnmatch
import random
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from proxy.core.circuit import Breaker
from proxy.core.headers import (
    DEFAULT_REQUEST_POLICY,
    DEFAULT_RESPONSE_POLICY,
    HeaderPolicy,
    request_policy,
    response_policy,
)
from proxy.core.replicas import ReplicaPool
from proxy.core.seam import Pool, Timeouts
from proxy.settings import RetrySettings, Settings, UpstreamSettings, display_url

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
    timeout: Timeouts
    ttft_timeout: float
    total_timeout: float | None
    retry: RetryPolicy
    breaker: Breaker
    fallback: list[str] = field(default_factory=list)
    pool: Pool | None = None
    display_url: str = ""  # base_url without user info or query: safe for logs and errors
    # What looks wrong in this upstream's configuration: logged at start-up, shown on status routes.
    config_warnings: tuple[str, ...] = ()
    # Which client headers reach it, and which of its answer's headers reach the client.
    request_policy: HeaderPolicy = DEFAULT_REQUEST_POLICY
    response_policy: HeaderPolicy = DEFAULT_RESPONSE_POLICY
    # Several servers behind this name (`replicas = [...]`): None for a base_url upstream.
    replicas: ReplicaPool | None = None

    def __post_init__(self) -> None:
        self.display_url = display_url(self.base_url)
        self.config_warnings = base_url_warnings(self.name, self.base_url) if self.base_url else ()

    @classmethod
    def from_settings(cls, s: UpstreamSettings, settings: Settings) -> Upstream:
        t = s.effective_timeouts(settings.timeouts)
        up = cls(
            s.name,
            s.base_url,
            list(s.models),
            dict(s.headers),
            s.api_key_env,
            s.api_key(),
            Timeouts(t.connect, t.pool, t.idle),
            t.ttft,
            t.total,
            RetryPolicy.from_settings(s.effective_retry(settings.retry)),
            Breaker.from_settings(settings.circuit),
            list(s.fallback),
            Pool(s.name, s.max_connections),
        )
        if s.replicas:
            up.replicas = ReplicaPool(
                s.name,
                s.balance,
                lambda: Breaker.from_settings(settings.circuit),
                s.balance_load_factor,
                s.session_header,
                s.dns(),
                s.discovery_interval_seconds,
            )
            up.replicas.set_members(s.urls())
            up.display_url = ", ".join(display_url(r) for r in s.replicas)
            up.config_warnings = tuple(w for url in s.urls() for w in base_url_warnings(s.name, url))
        if s.forward_headers:
            up.request_policy = request_policy(s.forward_headers)
        if s.return_headers:
            up.response_policy = response_policy(s.return_headers)
        return up

    # For a pool, whether any replica may take a request; its breaker is unused (each replica's
    # circuit is its own: one sick replica must not take the pool away).
    def available(self, now: float) -> bool:
        return self.breaker.available(now) if self.replicas is None else self.replicas.available(now)

    def describe(self, now: float) -> str:
        return self.breaker.describe(now) if self.replicas is None else self.replicas.describe(now)

    def retry_in(self, now: float) -> float:
        return self.breaker.retry_in(now) if self.replicas is None else self.replicas.retry_in(now)

    def url(self, suffix: str) -> str:
        """`suffix` is the path after /v1, e.g. `/chat/completions`."""
        return self.base_url + suffix

    def matches(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


def base_url_warnings(name: str, base_url: str) -> tuple[str, ...]:
    """A base URL with no path at all is almost always a forgotten /v1: vLLM, SGLang, llama.cpp and
    OpenAI itself answer under it, and requests would otherwise go to HOST/chat/completions (404)."""
    if urlsplit(base_url).path.strip("/"):
        return ()
    url = display_url(base_url).rstrip("/")
    return (
        f"upstream '{name}': base_url {url} has no path, but OpenAI-compatible servers answer under "
        f"/v1 (requests would go to {url}/chat/completions). If yours does too, write {url}/v1: "
        f'--upstream {name}={url}/v1, or base_url = "{url}/v1" in [[upstreams]].',
    )


class ModelRouter:
    """First upstream whose `models` patterns match wins; the default one catches the rest."""

    def __init__(self, upstreams: list[Upstream], default: Upstream) -> None:
        self.upstreams = upstreams
        self.default = default
        by_name = {u.name: u for u in upstreams}
        self._plans = {u.name: [u, *(by_name[f] for f in u.fallback)] for u in upstreams}
        self._affinity = {
            name: next(
                (u.replicas.session_header.encode() for u in plan if u.replicas and u.replicas.wants_key),
                None,
            )
            for name, plan in self._plans.items()
        }

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelRouter:
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

    def affinity_header(self, first: Upstream) -> bytes | None:
        """The session header of the first prefix_affinity pool in `first`'s plan: None when no
        pool there wants a conversation key (nothing computed per request)."""
        return self._affinity[first.name]

    def plan(self, first: Upstream) -> list[Upstream]:
        """The routed upstream, then its fallbacks, in order."""
        return self._plans[first.name]
