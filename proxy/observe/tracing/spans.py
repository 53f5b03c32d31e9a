"""OpenTelemetry traces: the TracingObserver (the export's set-up is export.py's).

With export.py, the only module that imports opentelemetry (import-linter holds it). Tracing is
off until an OTLP endpoint is set (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT
or `[tracing] endpoint`; the OTEL_* variables win); while off, `build_tracing` returns None and no
observer exists at all.

Per request, a SERVER span (parent: the caller's W3C `traceparent`) and a CLIENT span per
upstream attempt whose context goes upstream as `traceparent`, so engine traces join. Export is
batched on a background thread: a slow or dead collector drops spans, never delays a request.
The provider belongs to the observer (the global one is never set), so apps don't interfere.

Choices, following the GenAI and HTTP semantic conventions:
- `gen_ai.provider.name` is "openai": the API infertap speaks to every upstream (vLLM, SGLang
  and TaoToken all serve it); the configured upstream name is in `infertap.upstream`.
- Response, usage and timing attributes go on the SERVER span, the whole request as the caller
  saw it. Attempt spans carry the request attributes and HTTP status but no `gen_ai.usage.*`,
  so backends that add up usage per span don't count a request twice.
- Status: OK for outcome `ok`, ERROR with `error.type` = outcome otherwise, except that a SERVER
  span stays UNSET for a caller's own 4xx (`client_error` relayed from the upstream, `rejected`
  by infertap), as HTTP server spans do; `infertap.outcome` always names the outcome, and the
  attempt (CLIENT) span of a `client_error` is ERROR, as HTTP client spans are.
- Timestamps: one wall-clock anchor per request (`started_unix_ns`) plus perf_counter offsets,
  so a span lasts exactly `ex.duration` and events sit at `ex.ttft` etc.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from mypy_extensions import mypyc_attr
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy import __version__
from proxy.core.errors import timeout_phase
from proxy.core.exchange import Exchange, Outcome
from proxy.core.hooks import Observer
from proxy.core.route_table import route_of
from proxy.observe.tracing.export import default_sampler, service_resource
from proxy.observe.tracing.genai_content import Budget, input_messages
from proxy.observe.tracing.record import Attrs, SpanRecord, SpanRecorder, hex_id
from proxy.settings import TracingSettings

log = logging.getLogger("infertap.tracing")

PROVIDER = "openai"
_CALLER_FAULTS = frozenset({Outcome.CLIENT_ERROR, Outcome.REJECTED})
_MAX_DESCRIPTION = 512
# Proposed Exchange field: how many characters of the answer the core should collect.


# -- spans --------------------------------------------------------------------------------------
@dataclass(slots=True)
class _State:
    server: SpanRecord
    name: str
    request: Attrs
    attempt: SpanRecord | None = None

    # Written out, as SpanRecord's is (the generated one runs as Python).
    def __init__(
        self, server: SpanRecord, name: str, request: Attrs, attempt: SpanRecord | None = None
    ) -> None:
        self.server = server
        self.name = name
        self.request = request
        self.attempt = attempt


def _wall(ex: Exchange, t: float) -> int:
    """Wall-clock ns of perf_counter() time `t`: one anchor per request, so spans can't skew."""
    return ex.started_unix_ns + int((t - ex.received_at) * 1e9)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _request_attrs(ex: Exchange) -> tuple[str, Attrs]:
    op = route_of(ex.route).operation
    attrs: Attrs = {"infertap.request_id": ex.request_id, "infertap.client": ex.client}
    if op is None:
        name = f"{ex.method} {ex.route}"
    else:
        name = f"{op} {ex.model}" if ex.model else op
        attrs["gen_ai.operation.name"] = op
        attrs["gen_ai.provider.name"] = PROVIDER
        attrs["gen_ai.request.stream"] = ex.stream
        if ex.prompt_class:
            attrs["infertap.prompt_class"] = ex.prompt_class
    if ex.model:
        attrs["gen_ai.request.model"] = ex.model
    p = ex.params
    max_tokens = p.get("max_tokens", p.get("max_completion_tokens", p.get("max_output_tokens")))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        attrs["gen_ai.request.max_tokens"] = max_tokens
    for key in ("temperature", "top_p"):
        if _number(p.get(key)):
            attrs[f"gen_ai.request.{key}"] = float(p[key])
    if ex.upstream:
        attrs["infertap.upstream"] = ex.upstream
    if ex.upstream_url:
        server = _server(ex.upstream_url)
        if server is not None:
            attrs["server.address"], attrs["server.port"] = server
    return name, attrs


@functools.lru_cache(maxsize=256)  # a few upstream URLs (a pool's replicas), a request each
def _server(upstream_url: str) -> tuple[str, int] | None:
    url = urlsplit(upstream_url)
    if not url.hostname:
        return None
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


def _response_attrs(ex: Exchange) -> Attrs:
    # An enum's `_value_`, its str() without Enum.__str__'s call (the same string).
    outcome: Outcome | None = ex.outcome
    attrs: Attrs = {
        "infertap.outcome": "None" if outcome is None else outcome._value_,
        "infertap.attempts": ex.attempts,
    }
    attrs["infertap.retries"] = ex.retries
    if ex.replica is not None:
        attrs["infertap.replica"] = ex.replica  # a pool's replica, its address
    if ex.status_code is not None:
        attrs["http.response.status_code"] = ex.status_code
    if ex.response_model:
        attrs["gen_ai.response.model"] = ex.response_model
    if ex.response_id:
        attrs["gen_ai.response.id"] = ex.response_id
    if ex.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = tuple(ex.finish_reasons)
    if ex.prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = ex.prompt_tokens
    if ex.completion_tokens is not None or ex.output_events:
        attrs["gen_ai.usage.output_tokens"] = ex.output_tokens
        attrs["infertap.output_tokens_source"] = ex.token_source._value_
    if ex.cached_tokens is not None:
        attrs["gen_ai.usage.cache_read.input_tokens"] = ex.cached_tokens
    if ex.reasoning_tokens is not None:
        attrs["infertap.usage.reasoning_tokens"] = ex.reasoning_tokens
    if ex.cost is not None:
        attrs["infertap.cost"] = ex.cost
    # The same Exchange properties the metrics observe.
    ttft = ex.ttft
    timings = (
        ("infertap.ttft_s", ttft),
        ("infertap.ttft_answer_s", ex.ttft_answer),
        ("infertap.tpot_s", ex.tpot),
        ("infertap.ttfb_s", ex.ttfb),
    )
    for key, value in timings:  # the keys whole (an f-string made each anew, once a request)
        if value is not None:
            attrs[key] = value
    if ttft is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = ttft
    if ex.duration is not None:
        attrs["infertap.duration_s"] = ex.duration
    return attrs


def _fail(span: SpanRecord, kind: str, message: str | None) -> None:
    span.fail(kind, (message or kind)[:_MAX_DESCRIPTION])


# -- the observer -------------------------------------------------------------------------------
# Native (proxy/compiled/), and open to subclasses that are not compiled, as the metrics' is.
@mypyc_attr(allow_interpreted_subclasses=True)
class TracingObserver(Observer):
    """Spans from observer hooks. Give it an exporter (batched) or a ready span processor."""

    name = "tracing"

    def __init__(
        self,
        settings: TracingSettings,
        *,
        exporter: SpanExporter | None = None,
        processor: SpanProcessor | None = None,
        resource: Resource | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        if processor is None:
            if exporter is None:
                raise ValueError("TracingObserver needs an exporter or a span processor")
            processor = BatchSpanProcessor(exporter)
        self.capture_content = settings.capture_content
        self.content_max_chars = settings.content_max_chars
        ours = default_sampler(settings) if sampler is None else None
        self.provider = TracerProvider(
            resource=resource if resource is not None else service_resource(settings),
            sampler=sampler if sampler is not None else ours,
        )
        # The provider owns the processor (its shutdown flushes it); the spans go to it directly.
        self.provider.add_span_processor(processor)
        self._spans = SpanRecorder(
            self.provider, processor, "infertap", __version__, children_follow_parent=ours is not None
        )
        self._propagator = TraceContextTextMapPropagator()

    def request_received(self, ex: Exchange) -> None:
        parent, parent_context = None, None
        if ex.trace_context:
            parent_context = self._propagator.extract(ex.trace_context)
            parent = trace.get_current_span(parent_context).get_span_context()
        name, attrs = _request_attrs(ex)
        server_attrs: Attrs = {**attrs, "http.request.method": ex.method, "url.path": ex.path}
        span = self._spans.start(
            name, SpanKind.SERVER, server_attrs, ex.started_unix_ns, parent, parent_context
        )
        ctx = span.context
        if ctx.trace_flags & TraceFlags.SAMPLED:
            ex.trace_id = hex_id(ctx.trace_id, 16)
        ex.scratch[self.name] = _State(span, name, attrs)
        if self.capture_content:
            # One character over the cap, so that cutting the answer shows as truncated.
            ex.capture_output_chars = max(ex.capture_output_chars, self.content_max_chars + 1)

    def attempt_started(self, ex: Exchange) -> None:
        st: _State | None = ex.scratch.get(self.name)
        if st is None:
            return
        if st.attempt is not None:
            self._spans.end(st.attempt)
        started = ex.attempt_started_at if ex.attempt_started_at is not None else time.perf_counter()
        span = self._spans.start(
            st.name,
            SpanKind.CLIENT,
            {**st.request, "infertap.attempt": ex.attempts},
            _wall(ex, started),
            st.server.context,
        )
        st.attempt = span
        traceparent, tracestate = span.traceparent()
        ex.upstream_headers["traceparent"] = traceparent
        if tracestate:
            ex.upstream_headers["tracestate"] = tracestate

    def first_byte(self, ex: Exchange) -> None:
        st: _State | None = ex.scratch.get(self.name)
        if st is not None and st.attempt is not None and ex.status_code is not None:
            st.attempt.set_attributes({"http.response.status_code": ex.status_code})

    def retry(self, ex: Exchange, reason: str, backoff: float) -> None:
        st: _State | None = ex.scratch.get(self.name)
        if st is None:
            return
        # The failed attempt ended before the backoff; the hook comes as the next attempt goes.
        now = _wall(ex, ex.attempt_failed_at if ex.attempt_failed_at is not None else time.perf_counter())
        if st.attempt is not None:
            _fail(st.attempt, reason, f"attempt {ex.attempts} failed: {reason}")
            self._spans.end(st.attempt, now)
            st.attempt = None
        st.server.add_event(
            "retry",
            {
                "infertap.retry.reason": reason,
                "infertap.retry.backoff_s": float(backoff),
                "infertap.attempt": ex.attempts,
            },
            now,
        )

    def first_token(self, ex: Exchange) -> None:
        st: _State | None = ex.scratch.get(self.name)
        if st is not None and ex.first_token_at is not None and ex.ttft is not None:
            st.server.add_event("first_token", {"infertap.ttft_s": ex.ttft}, _wall(ex, ex.first_token_at))

    def ended(self, ex: Exchange) -> None:
        st: _State | None = ex.scratch.pop(self.name, None)
        if st is None:
            return
        end = _wall(ex, ex.finished_at if ex.finished_at is not None else time.perf_counter())
        outcome = ex.outcome if ex.outcome is not None else Outcome.UPSTREAM_ERROR
        attrs = _response_attrs(ex)
        if st.attempt is not None:
            if outcome is Outcome.OK:
                st.attempt.succeed()
            else:
                _fail(st.attempt, outcome._value_, ex.error_message)
            self._spans.end(st.attempt, end)
        server = st.server
        server.set_attributes(attrs)
        if ex.first_answer_at is not None and ex.first_answer_at != ex.first_token_at:
            # A reasoning model's answer starts later than its first (reasoning) token.
            answer = {"infertap.ttft_answer_s": ex.ttft_answer or 0.0}
            server.add_event("first_answer_token", answer, _wall(ex, ex.first_answer_at))
        if self.capture_content:
            server.set_attributes(self._content(ex))
        phase = timeout_phase(outcome._value_)
        if phase is not None:
            server.add_event("timeout", {"infertap.timeout.phase": phase}, end)
        elif outcome is Outcome.CLIENT_DISCONNECT:
            phase = (
                "before_first_byte"
                if ex.first_byte_at is None
                else ("before_first_token" if ex.first_token_at is None else "streaming")
            )
            server.add_event("client_disconnect", {"infertap.disconnect.phase": phase}, end)
        elif outcome is Outcome.STREAM_INTERRUPTED:
            server.add_event("stream_interrupted", {"infertap.output_events": ex.output_events}, end)
        if outcome is Outcome.OK:
            server.succeed()
        elif outcome not in _CALLER_FAULTS:
            _fail(server, outcome._value_, ex.error_message)
        self._spans.end(server, end)

    def _content(self, ex: Exchange) -> Attrs:
        """Prompts and completions, only with capture_content."""
        budget, out_budget = Budget(self.content_max_chars), Budget(self.content_max_chars)
        attrs: Attrs = {}
        # By name, as Python reads an attribute: compiled, `ex.request_json` would read the native
        # Exchange's own field even where a subclass declares the field again as its own (a
        # dataclass over Exchange does), and miss the value. Once a request, with capture on only.
        request = getattr(ex, "request_json", None)
        if isinstance(request, dict):
            messages = input_messages(ex.route, request, budget)
            if messages:
                attrs["gen_ai.input.messages"] = orjson.dumps(messages).decode()
        text = getattr(ex, "output_text", None)
        if isinstance(text, str):
            out: dict[str, Any] = {
                "role": "assistant",
                "parts": [{"type": "text", "content": out_budget.take(text)}],
            }
            if ex.finish_reasons:
                out["finish_reason"] = ex.finish_reasons[0]
            attrs["gen_ai.output.messages"] = orjson.dumps([out]).decode()
        if budget.cut or out_budget.cut:
            attrs["infertap.content_truncated"] = True
        return attrs

    def close(self) -> None:
        """Flushes what is queued and stops the export thread."""
        self.provider.shutdown()
