"""What tracing costs per request in the event loop's thread: the OpenTelemetry SDK by itself (the
same spans, attributes and event infertap makes, built with the SDK's own calls), against
infertap's TracingObserver given a finished Exchange hook by hook. Both end spans into a
BatchSpanProcessor whose exporter drops them, so the export thread does next to nothing; the
number is thread CPU time of this thread, warm, no I/O.

  .venv/bin/python scripts/perf/otel_floor.py [N]

The bench's tracing target (tracing on <= 1.2x the CPU per request of tracing off, in the event
loop's thread) leaves about 0.2x of a zero-delay stream's CPU for this work (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxy.core.exchange import Exchange, Outcome  # noqa: E402
from proxy.observe.tracing.spans import TracingObserver  # noqa: E402
from proxy.settings import TracingSettings  # noqa: E402


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _processor() -> BatchSpanProcessor:
    return BatchSpanProcessor(_Drop(), max_queue_size=1 << 20)


def sdk_only() -> Callable[[], None]:
    """Two spans (SERVER, and CLIENT for the attempt) with infertap's attribute counts: 12 and 11
    at the start, a status code, one event, 22 at the end."""
    provider = TracerProvider()
    provider.add_span_processor(_processor())
    tracer = provider.get_tracer("floor")
    request = {f"gen_ai.request.a{i}": "value" for i in range(10)}
    response = {f"infertap.r{i}": 1.5 for i in range(22)}

    def one() -> None:
        now = time.time_ns()
        attrs = {**request, "http.request.method": "POST", "url.path": "/v1/chat/completions"}
        server = tracer.start_span("chat m", None, SpanKind.SERVER, attrs, start_time=now)
        ctx = trace.set_span_in_context(server)
        attempt = tracer.start_span("chat m", ctx, SpanKind.CLIENT, {**request, "a": 1}, start_time=now)
        attempt.set_attribute("http.response.status_code", 200)
        server.add_event("first_token", {"infertap.ttft_s": 0.1}, now)
        attempt.set_status(Status(StatusCode.OK))
        attempt.end(now)
        server.set_attributes(response)
        server.set_status(Status(StatusCode.OK))
        server.end(now)

    return one


def observer() -> Callable[[], None]:
    """infertap's TracingObserver, every hook a streamed chat completion calls."""
    obs = TracingObserver(TracingSettings(), processor=_processor())

    def one() -> None:
        ex = Exchange("req-1", "/v1/chat/completions", "POST", "/v1/chat/completions")
        ex.model, ex.stream, ex.params = "m", True, {"max_tokens": 100, "temperature": 0.7}
        ex.upstream, ex.upstream_url = "vllm", "http://127.0.0.1:8000/v1"
        obs.request_received(ex)
        ex.attempts, ex.attempt_started_at = 1, ex.received_at
        obs.attempt_started(ex)
        ex.status_code, ex.first_byte_at = 200, ex.received_at + 0.01
        obs.first_byte(ex)
        ex.first_token_at = ex.first_answer_at = ex.received_at + 0.05
        obs.first_token(ex)
        ex.output_events, ex.prompt_tokens, ex.completion_tokens = 100, 20, 100
        ex.response_id, ex.response_model, ex.finish_reasons = "chatcmpl-1", "m", ["stop"]
        ex.last_token_at = ex.finished_at = ex.received_at + 1.0
        ex.outcome = Outcome.OK
        obs.ended(ex)

    return one


def per_request_us(one: Callable[[], None], n: int) -> float:
    for _ in range(n // 10):
        one()
    start = time.thread_time()
    for _ in range(n):
        one()
    return (time.thread_time() - start) / n * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    print(f"OpenTelemetry SDK alone, the same spans: {per_request_us(sdk_only(), n):6.1f} us per request")
    print(f"infertap's TracingObserver, every hook:  {per_request_us(observer(), n):6.1f} us per request")


if __name__ == "__main__":
    main()
