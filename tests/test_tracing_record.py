"""The tracing observer's spans (proxy/observe/tracing/record.py) against the SDK's own: the same
start, attributes, events, status and end, through SpanRecorder and through the SDK's Tracer, must
hand the span processor the same span: same fields, same attribute values (a list where the SDK
keeps a tuple fails), same cuts under the OTEL_*_LIMIT variables, same sampling, and the same OTLP
bytes. Randomized (hypothesis); a change in the SDK that record.py does not follow fails here."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState

from proxy.observe.tracing.record import SpanRecorder

SAMPLERS = {
    "parent-based on": ParentBased(ALWAYS_ON),
    "parent-based ratio": ParentBased(TraceIdRatioBased(0.5)),
    "off": ALWAYS_OFF,
    "record only": StaticSampler(Decision.RECORD_ONLY),
}
LIMITS = (
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_EVENT_COUNT_LIMIT",
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT",
)


class _Kept(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


class _SeededIds(RandomIdGenerator):
    """The same ids, in the same order, for both providers."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def generate_span_id(self) -> int:
        return self.rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self.rng.getrandbits(128) or 1


keys = st.sampled_from([f"k{i}" for i in range(12)] + ["gen_ai.request.model", "error.type"])
values = st.one_of(
    st.text(max_size=12),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.lists(st.text(max_size=6), max_size=3).map(tuple),
)
attrs = st.dictionaries(keys, values, max_size=8)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), attrs),
        st.tuples(st.just("event"), st.sampled_from(["retry", "first_token"]), attrs),
        st.tuples(st.just("fail"), st.sampled_from(["timeout", "upstream_error"]), st.text(max_size=20)),
        st.tuples(st.just("ok")),
    ),
    max_size=10,
)
parents = st.one_of(
    st.none(),
    st.tuples(st.booleans(), st.booleans(), st.sampled_from(["", "vendor=abc", "a=1,b=2"])),
)
limits = st.fixed_dictionaries({}, optional={k: st.integers(0, 6).map(str) for k in LIMITS})


def _run(
    provider: TracerProvider,
    kept: _Kept,
    how: str,
    start_attrs: dict[str, Any],
    steps: list[Any],
    parent: Any,
) -> tuple[str, str]:
    """One span through the SDK's tracer ("sdk") or a SpanRecorder ("record"); its traceparent."""
    context = None
    parent_ctx = None
    if parent is not None:
        sampled, remote, state = parent
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        parent_ctx = SpanContext(
            0xABC, 0xDEF, remote, flags, TraceState.from_header([state]) if state else None
        )
        context = trace.set_span_in_context(NonRecordingSpan(parent_ctx))
    if how == "sdk":
        tracer = provider.get_tracer("infertap", "9.9")
        span = tracer.start_span("chat m", context, SpanKind.SERVER, start_attrs, start_time=1_000)
        for i, step in enumerate(steps):
            if step[0] == "set":
                span.set_attributes(step[1])
            elif step[0] == "event":
                span.add_event(step[1], step[2], 2_000 + i)
            elif step[0] == "fail":
                span.set_attribute("error.type", step[1])
                span.set_status(Status(StatusCode.ERROR, step[2]))
            else:
                span.set_status(Status(StatusCode.OK))
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        span.end(9_000)
        return carrier["traceparent"], carrier.get("tracestate", "")
    # ParentBased with its default delegates, as infertap's own sampler: a local parent's child
    # follows it without the sampler being asked.
    follows = isinstance(provider.sampler, ParentBased)
    recorder = SpanRecorder(provider, kept, "infertap", "9.9", children_follow_parent=follows)
    rec = recorder.start("chat m", SpanKind.SERVER, dict(start_attrs), 1_000, parent_ctx, context)
    for i, step in enumerate(steps):
        if step[0] == "set":
            rec.set_attributes(step[1])
        elif step[0] == "event":
            rec.add_event(step[1], step[2], 2_000 + i)
        elif step[0] == "fail":
            rec.fail(step[1], step[2])
        else:
            rec.succeed()
    recorder.end(rec, 9_000)
    return rec.traceparent()


def _fields(span: ReadableSpan) -> dict[str, Any]:
    return {
        "name": span.name,
        "context": span.context,
        "parent": span.parent,
        "kind": span.kind,
        "attributes": dict(span.attributes or {}),
        "dropped_attributes": span.dropped_attributes,
        "events": [
            (e.name, dict(e.attributes or {}), e.timestamp, e.dropped_attributes) for e in span.events
        ],
        "dropped_events": span.dropped_events,
        "status": (span.status.status_code, span.status.description),
        "times": (span.start_time, span.end_time),
        "resource": span.resource,
        "scope": span.instrumentation_scope,
        "links": list(span.links),
    }


@settings(max_examples=300, deadline=None)
@given(
    sampler=st.sampled_from(sorted(SAMPLERS)),
    seed=st.integers(0, 2**32),
    start_attrs=attrs,
    steps=ops,
    parent=parents,
    env=limits,
)
def test_a_recorded_span_is_the_span_the_sdk_would_make(
    sampler: str,
    seed: int,
    start_attrs: dict[str, Any],
    steps: list[Any],
    parent: Any,
    env: dict[str, str],
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        for key in LIMITS:
            mp.delenv(key, raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        got = {}
        for how in ("sdk", "record"):
            kept = _Kept()
            provider = TracerProvider(
                resource=Resource.create({"service.name": "t"}),
                sampler=SAMPLERS[sampler],
                id_generator=_SeededIds(seed),
            )
            provider.add_span_processor(kept)
            header = _run(provider, kept, how, start_attrs, steps, parent)
            got[how] = (header, kept.spans)
    (sdk_header, sdk_spans), (header, spans) = got["sdk"], got["record"]
    assert header == sdk_header
    assert [_fields(s) for s in spans] == [_fields(s) for s in sdk_spans]
    if spans:
        assert encode_spans(spans).SerializeToString() == encode_spans(sdk_spans).SerializeToString()


def test_an_ended_span_never_changes() -> None:
    """What the processor was handed is the export thread's to read: a hook after the end (a late
    failure) changes nothing, as on an ended SDK span."""
    kept = _Kept()
    provider = TracerProvider(sampler=ALWAYS_ON)
    recorder = SpanRecorder(provider, kept, "infertap", "9.9")
    rec = recorder.start("chat", SpanKind.CLIENT, {"a": 1}, 1)
    recorder.end(rec, 2)
    recorder.end(rec, 3)
    rec.add_event("late", {}, 4)
    rec.set_attributes({"b": 2})
    rec.fail("timeout", "late")
    rec.succeed()
    (span,) = kept.spans
    assert (span.end_time, list(span.events), dict(span.attributes or {})) == (2, [], {"a": 1})
    assert span.status.status_code is StatusCode.UNSET
