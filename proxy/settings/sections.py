"""The configuration's sections, each a typed model with its defaults and checks.

Keys never live here: an upstream names the environment variable that holds its key.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

TAOTOKEN_BASE_URL = "https://taotoken.net/api"
TAOTOKEN_HOST = "taotoken.net"
# Prompt size classes (the `prompt_class` label), in prompt tokens: <1k, 1k-4k, 4k-16k, >16k.
DEFAULT_PROMPT_CLASS_BOUNDS = (1024, 4096, 16384)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    admin_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="serve the operator API (/admin/*) only on this port, at admin_host; none: on port",
    )
    admin_host: str = Field(default="127.0.0.1", description="the address of admin_port")
    workers: int = Field(default=1, ge=1, le=256)
    max_body_bytes: int = Field(default=10 * 1024 * 1024, gt=0, description="larger bodies get 413")
    max_concurrency: int = Field(default=0, ge=0, description="requests at once per worker; 0 = no cap")
    # The edge (proxy/server/edge.py): limits on what a client sends before any key is checked.
    max_head_bytes: int = Field(
        default=64 * 1024, ge=1024, description="request line and headers, in all; larger: 431"
    )
    max_headers: int = Field(default=100, ge=10, description="headers per request; more: 431")
    max_header_line_bytes: int = Field(
        default=16 * 1024, ge=256, description="the request line, or one header's name and value; longer: 431"
    )
    head_timeout: float = Field(
        default=10.0,
        gt=0,
        description="seconds for a request's head to arrive, from its first byte; then 408",
    )
    body_timeout: float = Field(
        default=60.0, gt=0, description="seconds for a request's body to arrive, once its head has; then 408"
    )
    write_timeout: float = Field(
        default=60.0, gt=0, description="seconds a client may leave a full socket buffer unread; then aborted"
    )
    max_connections: int = Field(
        default=8192, ge=1, description="open client connections per worker; one more is answered 503"
    )
    upstream_client: Literal["httptools", "aiohttp"] = Field(
        default="httptools",
        description="the upstream HTTP client: httptools (on llhttp) or aiohttp; needs a restart",
    )
    log_level: str = "info"
    drain_timeout: float = Field(
        default=30.0, gt=0, description="after SIGTERM, how long streams in flight may take to finish"
    )
    drain_delay: float = Field(
        default=2.0,
        ge=0,
        description="after SIGTERM, new requests are still served this long (load balancers catch up)",
    )
    stream_headers: str = Field(
        default="first_token",
        pattern=r"^(first_token|immediately)$",
        description="a generation stream's status and headers: with its first output event (an error "
        "before it keeps its HTTP status) or immediately (a client timeout shorter than the time to "
        "first token still works; an error before it is an in-band event after 200)",
    )
    stream_keep_alive_seconds: float = Field(
        default=5.0,
        gt=0,
        description="with stream_headers = immediately: infertap's SSE comment after this long without "
        "traffic (the upstream's own comments go on as they arrive), until the first token",
    )
    # What one upstream stream may make infertap hold (proxy/core/sse.py), whatever the upstream sends.
    max_sse_event_bytes: int = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="an upstream SSE event still incomplete (no blank line) past this many bytes ends "
        "the stream: the attempt fails before the first token, an in-band error after it",
    )
    max_sse_held_bytes: int = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="what a stream may send before its first output event (all of it is held, so that "
        "a retry stays invisible); past it the attempt fails",
    )
    ready_needs_upstream: bool = Field(
        default=False, description="/readyz also needs one upstream whose circuit is not open"
    )
    upstream_check_interval: float = Field(
        default=15.0, gt=0, description="seconds between background GET /models checks (GET /status)"
    )
    upstream_check_timeout: float = Field(default=2.0, gt=0, description="each background check's limit")
    models_cache_seconds: float = Field(
        default=5.0,
        ge=0,
        description="GET /v1/models answers from the upstreams' lists fetched at most this long ago "
        "(a reload fetches them anew); 0: every call asks every upstream",
    )

    @model_validator(mode="after")
    def _drain(self) -> Self:
        if self.drain_delay > self.drain_timeout:
            raise ValueError("drain_delay must not be longer than drain_timeout")
        return self


class TimeoutSettings(_Section):
    """Seconds. Seed client defaults: connect 10 s, read 120 s (`read` is accepted for `idle`)."""

    connect: float = Field(default=10.0, gt=0, description="to open a connection to the upstream")
    ttft: float = Field(default=120.0, gt=0, description="per attempt, until the first output event")
    idle: float = Field(
        default=120.0,
        gt=0,
        validation_alias=AliasChoices("idle", "read"),
        description="longest silence while reading the upstream (also bounds the wait for headers)",
    )
    total: float | None = Field(default=None, gt=0, description="the whole request; none by default")
    pool: float = Field(default=10.0, gt=0, description="longest wait for a free pooled connection")

    @model_validator(mode="before")
    @classmethod
    def _one_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "read" in data and "idle" in data:
            raise ValueError("give idle or read (its other name), not both")
        return data


class RetrySettings(_Section):
    """Seed client defaults: 3 attempts, 2 s backoff."""

    max_attempts: int = Field(default=3, ge=1, le=20)
    backoff_seconds: float = Field(default=2.0, ge=0)
    max_backoff_seconds: float = Field(default=30.0, ge=0)


class CircuitSettings(_Section):
    """An upstream whose attempts fail at `failure_rate` or more over the last `window_seconds`
    (counted once it has seen `min_calls` attempts there) is skipped for `cooldown_seconds`, then
    probed again by one real request. Failures: connection problems, timeouts, 5xx (not 4xx or 429)."""

    failure_rate: float = Field(default=0.5, gt=0, le=1, description="share of failed attempts that opens")
    min_calls: int = Field(default=20, ge=1, description="attempts in the window before the rate counts")
    window_seconds: float = Field(default=30.0, gt=0, description="the sliding window the rate is over")
    cooldown_seconds: float = Field(default=30.0, gt=0, description="open this long, then one probe")
    when_all_open: str = Field(
        default="send",
        pattern=r"^(send|refuse)$",
        description="every candidate's circuit open: send anyway (panic mode) or answer 503",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: Any) -> Any:
        # `failure_threshold`, the consecutive-failure count this replaced, is read as min_calls so
        # that old configs keep working (a re-validated dump may carry both: min_calls wins).
        if isinstance(data, dict) and "failure_threshold" in data:
            data = dict(data)
            data.setdefault("min_calls", data.pop("failure_threshold"))
        return data


class AuthSettings(_Section):
    """Client keys. Never plain keys in this file: an env variable, or a file of SHA-256 hashes."""

    keys_env: str | None = Field(default=None, description="env variable with comma-separated keys")
    keys_file: str | None = Field(default=None, description="file of hex SHA-256 hashes, one a line")
    metrics_token_env: str | None = Field(
        default=None, description="env variable with a bearer token that /metrics and /ui require"
    )
    admin_token_env: str | None = Field(
        default=None,
        description="env variable with the bearer token that the operator API (/admin/*) requires; "
        "unset: the operator API is off",
    )
    open: bool = Field(
        default=False,
        description="say so to serve without client keys on an address beyond loopback (refused at "
        "start-up without it), or without client keys or the admin token after a reload that removes "
        "them (refused without it)",
    )


class MetricsSettings(_Section):
    """Prometheus metrics and the access log. Buckets are in seconds; None keeps the defaults."""

    models: list[str] | None = Field(
        default=None,
        description="glob allow-list for the `model` label (default: the upstreams' model patterns)",
    )
    max_models: int = Field(default=100, ge=1, description="distinct model label values; the rest is 'other'")
    prompt_class_bounds: list[int] = Field(default=list(DEFAULT_PROMPT_CLASS_BOUNDS), min_length=1)
    ttft_buckets: list[float] | None = None
    itl_buckets: list[float] | None = None
    tpot_buckets: list[float] | None = None
    duration_buckets: list[float] | None = None
    exemplars: bool = True
    overhead: bool = Field(
        default=True,
        description="infertap_overhead_seconds and infertap_event_loop_lag_seconds: infertap's own cost",
    )
    access_log: bool = True
    access_log_format: str = Field(default="json", pattern=r"^(json|logfmt)$")

    @field_validator("prompt_class_bounds", "ttft_buckets", "itl_buckets", "tpot_buckets", "duration_buckets")
    @classmethod
    def _increasing(cls, v: list[Any] | None) -> list[Any] | None:
        if v is not None and any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("must be strictly increasing")
        return v


class TracingSettings(_Section):
    """OpenTelemetry export. The standard OTEL_* variables work too and win over these."""

    endpoint: str | None = Field(default=None, description="OTLP endpoint; tracing is off without one")
    protocol: str = Field(default="http/protobuf", pattern=r"^(http/protobuf|grpc)$")
    service_name: str = "infertap"
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    capture_content: bool = Field(default=False, description="record prompts and completions (private!)")
    content_max_chars: int = Field(default=4096, ge=0)


class UISettings(_Section):
    """The built-in page at /ui (docs/ui.md): bounded in-memory rings, one set per worker."""

    enabled: bool = Field(default=True, description="serve /ui and /ui/data; false answers 404")
    window_seconds: int = Field(default=600, ge=10, le=3600, description="the history the charts span")
    step_seconds: int = Field(default=5, ge=1, le=300, description="one chart point (quantiles, rates)")
    recent_requests: int = Field(default=100, ge=1, le=10_000, description="rows in the last-requests table")
    samples_per_step: int = Field(
        default=200, ge=10, le=10_000, description="TTFT/TPOT samples kept per model and step (then sampled)"
    )
    refresh_seconds: float = Field(default=2.0, ge=0.5, le=60, description="how often the page reloads")

    @model_validator(mode="after")
    def _steps(self) -> Self:
        if self.window_seconds < 2 * self.step_seconds:
            raise ValueError("window_seconds must be at least twice step_seconds")
        return self


class LoopSettings(_Section):
    """Loop detection (proxy/observe/repetition.py): counts answers that repeat themselves in
    infertap_degenerate_responses_total. Off by default: it makes the SSE scanner parse every
    output event's JSON until `window_chars` of text are collected (cost: docs/doctor.md)."""

    enabled: bool = False
    window_chars: int = Field(default=2000, ge=100, le=100_000, description="text scored per answer")
    ngram: int = Field(default=4, ge=2, le=16, description="words per n-gram")
    threshold: float = Field(default=0.5, gt=0, le=1, description="repeated n-gram share that flags a loop")
    min_tokens: int = Field(default=40, ge=1, description="shorter answers are not scored")


class ClientSettings(_Section):
    """Who sent a request: the `client` label (docs/spend.md). With client keys the name comes from
    the key (`[auth]`); without them, an optional trusted header may name the client."""

    header: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9-]+$",
        description="trusted header naming the client when no client keys are set (e.g. X-Infertap-Client)",
    )
    max_clients: int = Field(
        default=100, ge=1, description="distinct client names from the header; the rest is 'other'"
    )


class PriceSettings(_Section):
    """Prices per million tokens for the models matching `models` (globs on the requested model)."""

    models: list[str] = Field(min_length=1, description="glob patterns; the first matching entry wins")
    input_per_mtok: float = Field(ge=0, description="per million prompt tokens not served from cache")
    cached_input_per_mtok: float | None = Field(
        default=None, ge=0, description="per million cached prompt tokens (default: input_per_mtok)"
    )
    output_per_mtok: float = Field(ge=0, description="per million completion tokens, reasoning included")


class SpendSettings(_Section):
    """What the tokens cost, from these prices only (no pricing service is ever called)."""

    currency: str = Field(default="USD", min_length=1, max_length=16)
    prices: list[PriceSettings] = Field(default_factory=list)
    daily_budget: float | None = Field(
        default=None, gt=0, description="per client and day, exported for the budget alert"
    )
    budgets: dict[str, float] = Field(
        default_factory=dict, description="per-client daily budgets (client name -> amount)"
    )

    @field_validator("budgets")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, x in v.items() if x <= 0)
        if bad:
            raise ValueError(f"budgets must be positive: {bad}")
        return v
