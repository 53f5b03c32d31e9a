"""Upstreams: the routing table (model -> upstream), the shared HTTP client, and how failures are named."""

from __future__ import annotations

import fnmatch
import random
import time
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import urlsplit

import aiohttp

from proxy.circuit import Breaker
from proxy.request import display_url
from proxy.settings import RetrySettings, Settings, UpstreamSettings


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
    # The upstream rejected the stream_options infertap added: asked again at once without it (a
    # retry reason only, never a request's outcome).
    STREAM_OPTIONS = "stream_options_rejected"


# Most specific first: aiohttp's exception classes form a hierarchy (its timeouts are also
# TimeoutErrors, so they must be told apart from infertap's own deadlines before those are).
_EXCEPTION_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (aiohttp.ConnectionTimeoutError, ErrorKind.CONNECT_TIMEOUT),
    (aiohttp.SocketTimeoutError, ErrorKind.IDLE_TIMEOUT),
    (aiohttp.ServerTimeoutError, ErrorKind.IDLE_TIMEOUT),
    (aiohttp.ClientConnectorError, ErrorKind.CONNECT_ERROR),
    (aiohttp.ServerDisconnectedError, ErrorKind.READ_ERROR),
    (aiohttp.ClientPayloadError, ErrorKind.READ_ERROR),
    (aiohttp.ClientResponseError, ErrorKind.UPSTREAM_5XX),
    (aiohttp.ClientConnectionError, ErrorKind.READ_ERROR),
)


def classify(exc: BaseException) -> ErrorKind:
    for exc_type, kind in _EXCEPTION_KINDS:
        if isinstance(exc, exc_type):
            return kind
    return ErrorKind.UPSTREAM_5XX


def describe(exc: BaseException) -> str:
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
    timeout: aiohttp.ClientTimeout
    ttft_timeout: float
    total_timeout: float | None
    retry: RetryPolicy
    breaker: Breaker
    fallback: list[str] = field(default_factory=list)
    display_url: str = ""  # base_url without user info or query: safe for logs and errors
    # What looks wrong in this upstream's configuration: logged at start-up, shown on status routes.
    config_warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.display_url = display_url(self.base_url)
        self.config_warnings = base_url_warnings(self.name, self.base_url)

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
            aiohttp.ClientTimeout(
                total=None, connect=t.connect + t.pool, sock_connect=t.connect, sock_read=t.idle
            ),
            t.ttft,
            t.total,
            RetryPolicy.from_settings(s.effective_retry(settings.retry)),
            Breaker.from_settings(settings.circuit),
            list(s.fallback),
        )

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


class Router:
    """First upstream whose `models` patterns match wins; the default one catches the rest."""

    def __init__(self, upstreams: list[Upstream], default: Upstream) -> None:
        self.upstreams = upstreams
        self.default = default
        self._by_name = {u.name: u for u in upstreams}
        self._plans = {u.name: [u, *(self._by_name[f] for f in u.fallback)] for u in upstreams}

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
        return self._plans[first.name]

    def by_name(self, name: str) -> Upstream | None:
        return self._by_name.get(name)


class StampedRequest(aiohttp.ClientRequest):
    """aiohttp's request, noting when its last byte went to the socket: the end of infertap's
    intake overhead. The response carries the stamp (`sent_at(resp)`) in a one-slot list that
    refers to nothing, so no reference cycle is made for the GC to collect."""

    _infertap_sent: list[float] | None = None

    async def send(self, conn: aiohttp.connector.Connection) -> aiohttp.ClientResponse:
        sent = self._infertap_sent = [0.0]
        resp = await super().send(conn)
        resp._infertap_sent = sent  # type: ignore[attr-defined]
        if not sent[0] and self._writer is None:  # nothing left to write: headers were all
            sent[0] = time.perf_counter()
        return resp

    async def write_bytes(
        self,
        writer: aiohttp.abc.AbstractStreamWriter,
        conn: aiohttp.connector.Connection,
        content_length: int | None = None,
    ) -> None:
        await super().write_bytes(writer, conn, content_length)
        if self._infertap_sent is not None:
            self._infertap_sent[0] = time.perf_counter()


def sent_at(resp: aiohttp.ClientResponse) -> float | None:
    """When the request behind `resp` was written (None: not known)."""
    sent: list[float] | None = getattr(resp, "_infertap_sent", None)
    return sent[0] or None if sent is not None else None


def make_client(max_connections: int = 1000) -> aiohttp.ClientSession:
    """One pooled client for all upstreams. Must be created inside the running event loop.

    aiohttp rather than httpx for the upstream side: its C parser and stream reader cost a
    fraction of httpx's per chunk, and its pool does not scan every connection on each request
    (httpcore's does, which dominated infertap's CPU at high concurrency; docs/benchmarks.md).
    No environment proxies (a stray HTTP_PROXY would buffer streams), no cookies, no
    decompression (bytes are relayed unchanged), no redirects.
    """
    connector = aiohttp.TCPConnector(
        limit=max_connections,
        limit_per_host=0,
        # Expire idle connections before a typical server's 5 s keep-alive closes them under us.
        keepalive_timeout=4.0,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        trust_env=False,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
        request_class=StampedRequest,
    )
