"""One request's record: what happened, when, and the timings derived from it.

Pure stdlib. Every observer reads the same record, so metrics, spans and the access log
can never disagree about a request's TTFT or TPOT.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mypy_extensions import mypyc_attr

from proxy.settings.sections import DEFAULT_PROMPT_CLASS_BOUNDS


class Outcome(StrEnum):
    """Closed vocabulary shared by the `outcome` label, span status and JSON error `type`."""

    OK = "ok"
    CLIENT_ERROR = "client_error"
    RATE_LIMITED = "rate_limited"
    UPSTREAM_ERROR = "upstream_error"
    CONNECT_ERROR = "connect_error"
    CONNECT_TIMEOUT = "connect_timeout"
    TTFT_TIMEOUT = "ttft_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    # No free connection to the upstream within [timeouts] pool: its max_connections are all busy.
    POOL_TIMEOUT = "pool_timeout"
    STREAM_INTERRUPTED = "stream_interrupted"
    CLIENT_DISCONNECT = "client_disconnect"
    REJECTED = "rejected"
    SHUTDOWN = "shutdown"  # still open when the drain after SIGTERM ran out


def prompt_class(tokens: int, bounds: tuple[int, ...] = DEFAULT_PROMPT_CLASS_BOUNDS) -> str:
    """A bounded size class of the prompt: `<1k`, `1k-4k`, `4k-16k`, `>16k` with the default bounds.

    TTFT grows with the prompt, so comparing TTFT within a class tells a regression apart
    from prompts merely getting longer.
    """
    names = _names(bounds)
    for i, bound in enumerate(bounds):
        if tokens < bound:
            return f"<{names[0]}" if i == 0 else f"{names[i - 1]}-{names[i]}"
    return f">{names[-1]}"


@functools.cache  # the configured bounds: one or two tuples a process
def _names(bounds: tuple[int, ...]) -> list[str]:
    return [_short(b) for b in bounds]


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


class TokenSource(StrEnum):
    USAGE = "usage"  # the upstream's usage object
    ESTIMATED = "estimated"  # counted output events; an event may carry several tokens


# An Enum's members read from its class go through EnumType's __getattr__ hook: once, here.
_USAGE, _ESTIMATED = TokenSource.USAGE, TokenSource.ESTIMATED


# Subclassed outside the compiled modules (proxy/compiled/): the tests extend the record.
@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(slots=True, eq=False)
class Exchange:
    """Monotonic timestamps come from time.perf_counter(); only `started_unix_ns` is wall-clock."""

    request_id: str
    route: str
    method: str
    path: str
    received_at: float = field(default_factory=time.perf_counter)
    started_unix_ns: int = field(default_factory=time.time_ns)
    model: str | None = None
    stream: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    prompt_chars: int = 0
    prompt_class: str = ""
    upstream: str | None = None
    upstream_url: str | None = None
    replica: str | None = None  # the pool replica of the current attempt (its display address)
    # Headers of the next upstream attempt; observers may add to them in attempt_started
    # (the tracing observer injects `traceparent` here).
    upstream_headers: dict[str, str] = field(default_factory=dict)
    attempts: int = 0
    retries: int = 0
    status_code: int | None = None
    attempt_started_at: float | None = None
    # When the latest failed attempt ended: where a retry's backoff began (the retry itself is
    # reported when the next attempt goes; the tracing observer ends the failed attempt's span here).
    attempt_failed_at: float | None = None
    first_byte_at: float | None = None
    # infertap's own overhead (infertap_overhead_seconds): when the first attempt's request was
    # written to the upstream's socket, and when the bytes carrying the first output event arrived.
    upstream_sent_at: float | None = None
    first_output_read_at: float | None = None
    first_token_at: float | None = None
    # The first answer event (content, not reasoning): later than first_token_at for a reasoning model.
    first_answer_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    output_events: int = 0
    # Inter-token gaps not yet handed to the observers (proxy/core/hooks.py, output_gaps): the
    # first event of each later read's gap; how many events came in the same read as another; and
    # when the next hand-over is due.
    gaps: list[float] = field(default_factory=list)
    zero_gaps: int = 0
    gaps_due: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # From the usage's details, when the upstream reports them (prompt_tokens_details.cached_tokens,
    # completion_tokens_details.reasoning_tokens, or the Responses API's input/output_tokens_details).
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    # The bounded client name (proxy/control/auth.py): a configured name, "anonymous", "unnamed" or "other".
    client: str = "anonymous"
    # What the tokens cost in [spend]'s currency; None when spend is off or the model has no price.
    cost: float | None = None
    unpriced: bool = False
    response_id: str | None = None
    response_model: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    outcome: Outcome | None = None
    error_message: str | None = None
    usage_injected: bool = False
    # Incoming W3C trace context (traceparent, tracestate), for the tracing observer.
    trace_context: dict[str, str] = field(default_factory=dict)
    # Set by the tracing observer when a span is recorded; metrics attach it as an exemplar.
    trace_id: str | None = None
    # Content, for opt-in capture only (tracing's capture_content). The parsed request body
    # (a reference, no copy); and the relayed answer's text, collected only when an observer
    # sets `capture_output_chars` > 0 in request_received (at most that many characters).
    request_json: dict[str, Any] | None = None
    capture_output_chars: int = 0
    output_text: str | None = None
    # Per-request state for observers (a span, say), keyed by the observer's name.
    scratch: dict[str, Any] = field(default_factory=dict)

    # Written out, where dataclass would generate it: compiled (proxy/compiled/), this costs a
    # tenth of the generated one, which runs as Python, once a request. It sets every field to its
    # declared default; tests/test_compiled.py holds the two to each other.
    def __init__(
        self,
        request_id: str,
        route: str,
        method: str,
        path: str,
        *,
        received_at: float | None = None,
        started_unix_ns: int | None = None,
        model: str | None = None,
        upstream: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.method = method
        self.path = path
        self.received_at = time.perf_counter() if received_at is None else received_at
        self.started_unix_ns = time.time_ns() if started_unix_ns is None else started_unix_ns
        self.model = model
        self.stream = False
        self.params = {}
        self.prompt_chars = 0
        self.prompt_class = ""
        self.upstream = upstream
        self.upstream_url = None
        self.replica = None
        self.upstream_headers = {}
        self.attempts = 0
        self.retries = 0
        self.status_code = None
        self.attempt_started_at = None
        self.attempt_failed_at = None
        self.first_byte_at = None
        self.upstream_sent_at = None
        self.first_output_read_at = None
        self.first_token_at = None
        self.first_answer_at = None
        self.last_token_at = None
        self.finished_at = None
        self.output_events = 0
        self.gaps = []
        self.zero_gaps = 0
        self.gaps_due = 0.0
        self.prompt_tokens = None
        self.completion_tokens = None
        self.cached_tokens = None
        self.reasoning_tokens = None
        self.client = "anonymous"
        self.cost = None
        self.unpriced = False
        self.response_id = None
        self.response_model = None
        self.finish_reasons = []
        self.outcome = None
        self.error_message = None
        self.usage_injected = False
        self.trace_context = {}
        self.trace_id = None
        self.request_json = None
        self.capture_output_chars = 0
        self.output_text = None
        self.scratch = {}

    @property
    def ttft(self) -> float | None:
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.received_at

    @property
    def ttft_answer(self) -> float | None:
        """Time to the first answer token (after any reasoning): what a reasoning model's user waits."""
        if self.first_answer_at is None:
            return None
        return self.first_answer_at - self.received_at

    @property
    def intake_overhead(self) -> float | None:
        """From the request's arrival to its upstream request written: infertap's intake."""
        if self.upstream_sent_at is None:
            return None
        return self.upstream_sent_at - self.received_at

    @property
    def first_token_overhead(self) -> float | None:
        """From the first output event's bytes arriving from the upstream to their being handed to
        the client."""
        if self.first_output_read_at is None or self.first_token_at is None:
            return None
        return self.first_token_at - self.first_output_read_at

    @property
    def ttfb(self) -> float | None:
        if self.first_byte_at is None:
            return None
        return self.first_byte_at - self.received_at

    @property
    def duration(self) -> float | None:
        if self.finished_at is None:
            return None
        return self.finished_at - self.received_at

    @property
    def output_tokens(self) -> int:
        """Usage from the upstream when it sent one, else the count of output events."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.output_events

    @property
    def token_source(self) -> TokenSource:
        # Embeddings produce no completion: their usage holds the prompt tokens alone.
        counted = self.prompt_tokens if self.route == "embeddings" else self.completion_tokens
        return _USAGE if counted is not None else _ESTIMATED

    @property
    def ttft_of_attempt(self) -> float | None:
        """From the committed attempt's start to the first token: a replica's own TTFT."""
        if self.first_token_at is None or self.attempt_started_at is None:
            return None
        return self.first_token_at - self.attempt_started_at

    @property
    def tpot(self) -> float | None:
        """(last output event - first output event) / (output tokens - 1)."""
        if self.first_token_at is None or self.last_token_at is None:
            return None
        tokens = self.output_tokens
        if tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (tokens - 1)

    @property
    def decode_time(self) -> float | None:
        if self.first_token_at is None or self.last_token_at is None:
            return None
        return self.last_token_at - self.first_token_at

    @property
    def estimated_prompt_tokens(self) -> int:
        """Prompt size at arrival, before the upstream reports usage: ~4 characters a token."""
        return (self.prompt_chars + 3) // 4


@dataclass(slots=True, eq=False)
class LocalAnswer:
    """A request infertap answered itself, without the forwarder: refused before it was read (a
    wrong or missing client key, a wrong method, the operator API on the wrong port) or served
    by one of its own routes (/v1/models, the probes, /metrics, /ui, /docs, /admin/*, an unknown
    path's 404). It has no Exchange: nothing of it is measured but its status and duration."""

    request_id: str
    method: str
    # A closed vocabulary (proxy/control/dispatch.py, route_class): a proxied route's label for a
    # refused OpenAI request, else models, healthz, readyz, metrics, status, ui, docs, admin, unknown.
    route: str
    received_at: float = field(default_factory=time.perf_counter)
    started_unix_ns: int = field(default_factory=time.time_ns)
    status: int = 0
    finished_at: float | None = None
    # The bounded client name of a /v1/ request past the key check (a 405, GET /v1/models); else None.
    client: str | None = None

    @property
    def duration(self) -> float | None:
        if self.finished_at is None:
            return None
        return self.finished_at - self.received_at
