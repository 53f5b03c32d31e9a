"""A span as infertap records it: plain fields that the tracing observer's hooks fill, made into
the SDK's `ReadableSpan` once, when it ends, and handed to the span processor.

Why not the SDK's own `Span`: it cleans and copies every attribute under a lock as it is set
(`BoundedAttributes`), and a request's two spans carry about forty. That was most of tracing's
cost on the event loop: the SDK alone takes about 65 µs per request to make infertap's two spans
(scripts/perf/otel_floor.py), the observer with these records about 24 µs for all its hooks as
Python, 17.5 µs compiled (docs/benchmarks.md, "Tracing: spans made once, at their end" and
"Tracing compiled"). infertap's
attribute values come from typed fields (str, int, float, bool, a tuple of str), which the
cleaning leaves as they are.

What the SDK's tracer decides stays the SDK's: the provider's sampler (its attributes and trace
state included), its id generator, its resource, and the span limits the OTEL_*_LIMIT variables
set: where one is set below what infertap's spans can reach, records keep their attributes and
events in the SDK's own `BoundedAttributes` and `BoundedList` from the start, as its spans do. A test
replays randomized spans through the SDK's tracer and compares every field and the OTLP encoding
byte for byte (tests/test_tracing_record.py), so a change in the SDK that this would miss fails
loudly.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from time import time_ns
from typing import Final

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler, TraceIdRatioBased
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import AttributeValue

Attrs = dict[str, AttributeValue]

UNSET = Status(StatusCode.UNSET)
OK = Status(StatusCode.OK)
# W3C Trace Context level 2's random-trace-id flag (opentelemetry-api 1.39 on): 0 before it.
_RANDOM = int(getattr(TraceFlags, "RANDOM_TRACE_ID", 0))
_TRACE_ID_LIMIT: Final[int] = TraceIdRatioBased.TRACE_ID_LIMIT
# A span's flags by (sampled, random trace id), made once.
_FLAGS = {
    (sampled, random): TraceFlags((TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT) | random)
    for sampled in (False, True)
    for random in {0, _RANDOM}
}
# A flags byte as traceparent writes it (two hex digits).
_FLAGS_HEX: Final = tuple(f"{i:02x}" for i in range(256))


def hex_id(n: int, size: int) -> str:
    """An id as W3C Trace Context writes it: `size` bytes, two lowercase hex digits each (what
    `f"{n:0{2 * size}x}"` writes for an id that fits, at a third of its cost compiled: the format
    spec is parsed on every call, ~3,000 instructions, three ids a request)."""
    return n.to_bytes(size, "big").hex()


@dataclass(slots=True)
class SpanRecord:
    """A span being recorded (or, where the sampler dropped it, only its context). Once it has
    ended (`recording` false) nothing changes it, as nothing changes an ended SDK span: its
    attributes and events are the exported span's, which the export thread reads."""

    name: str
    context: SpanContext
    parent: SpanContext | None
    kind: SpanKind
    start: int
    recording: bool
    attributes: MutableMapping[str, AttributeValue]
    events: list[Event] | BoundedList[Event] = field(default_factory=list)
    status: Status = UNSET
    # (max attributes, max value length) of an event where the span limits could cut one
    event_limits: tuple[int | None, int | None] | None = None

    # Written out, where dataclass would generate it: compiled (proxy/compiled/), a tenth of the
    # generated one's cost, which runs as Python (two spans a request). tests/test_compiled.py
    # holds it to the fields.
    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        start: int,
        recording: bool,
        attributes: MutableMapping[str, AttributeValue],
        events: list[Event] | BoundedList[Event] | None = None,
        status: Status = UNSET,
        event_limits: tuple[int | None, int | None] | None = None,
    ) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start = start
        self.recording = recording
        self.attributes = attributes
        self.events = [] if events is None else events
        self.status = status
        self.event_limits = event_limits

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        """As the SDK's span sets them: a key set again moves to the end (which a count limit cuts
        last)."""
        if not self.recording:
            return
        attrs = self.attributes
        if type(attrs) is dict and attrs.keys().isdisjoint(attributes):
            attrs.update(attributes)
            return
        for key, value in attributes.items():
            attrs.pop(key, None)
            attrs[key] = value

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue], timestamp: int) -> None:
        if self.recording:
            if self.event_limits is not None:
                count, length = self.event_limits
                attributes = BoundedAttributes(count, attributes, True, length)
            self.events.append(Event(name, attributes, timestamp))

    def fail(self, kind: str, description: str) -> None:
        """ERROR with `error.type`, as the SDK's set_status would (an OK span stays OK)."""
        if not self.recording:
            return
        self.set_attributes({"error.type": kind})
        if self.status.status_code is not StatusCode.OK:
            self.status = Status(StatusCode.ERROR, description)

    def succeed(self) -> None:
        if self.recording:
            self.status = OK

    def traceparent(self) -> tuple[str, str]:
        """W3C `traceparent` and `tracestate` ("" when empty) for a request made inside this span:
        what TraceContextTextMapPropagator.inject writes for it."""
        ctx = self.context
        tp = f"00-{hex_id(ctx.trace_id, 16)}-{hex_id(ctx.span_id, 8)}-{_FLAGS_HEX[ctx.trace_flags]}"
        return tp, ctx.trace_state.to_header() if ctx.trace_state else ""


class SpanRecorder:
    """Starts records the way the SDK's Tracer.start_span starts spans, and ends them into the
    span processor."""

    def __init__(
        self,
        provider: TracerProvider,
        processor: SpanProcessor,
        name: str,
        version: str,
        *,
        children_follow_parent: bool = False,
    ) -> None:
        """`children_follow_parent`: the provider's sampler is a ParentBased whose delegates for a
        local parent are its defaults (ALWAYS_ON, ALWAYS_OFF), as infertap's own is: a span whose
        parent is local then takes the parent's decision and trace state without asking it."""
        self._follow = children_follow_parent
        self._sampler = provider.sampler
        self._ids = provider.id_generator
        self._resource = provider.resource
        self._processor = processor
        tracer = provider.get_tracer(name, version)
        # The deprecated twin of the scope that SDK spans still carry, for exporters that read it.
        self._info = getattr(tracer, "instrumentation_info", None)
        self._scope = InstrumentationScope(name, version)
        self._random = _RANDOM if getattr(self._ids, "is_trace_id_random", lambda: False)() else 0
        limits = SpanLimits()
        self._limits = limits
        # Below these, a limit could cut one of infertap's spans (about 40 attributes, events of
        # at most 3 attributes, one event per retry: at most 19, [retry] max_attempts <= 20); at
        # the SDK's defaults (128) none can.
        self._limited = not (
            limits.max_span_attribute_length is None
            and limits.max_attribute_length is None
            and _at_least(limits.max_span_attributes, 128)
            and _at_least(limits.max_event_attributes, 128)
            and _at_least(limits.max_events, 128)
        )
        self._event_limits = (limits.max_event_attributes, limits.max_attribute_length)
        # A root span's decision, where the sampler is a ParentBased whose root delegate decides by
        # the trace id alone (infertap's own: a ratio; or always on, or always off): its answer
        # without the call through ParentBased (which reads the current context, where infertap
        # never puts a span). (bound, decision at or above it); None: the sampler is asked.
        self._root: tuple[int, Decision] | None = None
        root = getattr(self._sampler, "_root", None) if type(self._sampler) is ParentBased else None
        if children_follow_parent and type(root) is TraceIdRatioBased:
            self._root = (root.bound, Decision.DROP)
        elif children_follow_parent and type(root) is StaticSampler:
            decision = root._decision  # what its should_sample answers, always
            if decision is not Decision.RECORD_ONLY:
                self._root = (0, decision)

    def start(
        self,
        name: str,
        kind: SpanKind,
        attributes: Attrs,
        start: int,
        parent: SpanContext | None = None,
        parent_context: Context | None = None,
    ) -> SpanRecord:
        """`parent` is the parent's SpanContext (None: a root span); `parent_context` the Context
        holding it, where the caller has one (an extracted `traceparent`)."""
        if parent is not None and not parent.is_valid:
            parent = None
        kept: Mapping[str, AttributeValue] | None
        state: TraceState | None
        if parent is None:
            trace_id = self._ids.generate_trace_id()
            random = self._random
            rule = self._root
            if rule is not None:
                # TraceIdRatioBased's test (and StaticSampler's constant): sampled below the bound.
                bound, above = rule
                sampled = trace_id & _TRACE_ID_LIMIT < bound
                decision = Decision.RECORD_AND_SAMPLE if sampled else above
                kept = attributes if decision is not Decision.DROP else None
                return self._made(name, kind, start, parent, trace_id, random, decision, kept, None)
        else:
            trace_id = parent.trace_id
            random = parent.trace_flags & _RANDOM
            if self._follow and not parent.is_remote:
                # What ParentBased's ALWAYS_ON / ALWAYS_OFF delegates answer (StaticSampler).
                sampled = parent.trace_flags.sampled
                decision = Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP
                state = parent.trace_state
                return self._made(name, kind, start, parent, trace_id, random, decision, attributes, state)
            if parent_context is None:
                parent_context = trace.set_span_in_context(NonRecordingSpan(parent))
        result = self._sampler.should_sample(parent_context, trace_id, name, kind, attributes, ())
        decision, kept, state = result.decision, result.attributes, result.trace_state
        return self._made(name, kind, start, parent, trace_id, random, decision, kept, state)

    def _made(
        self,
        name: str,
        kind: SpanKind,
        start: int,
        parent: SpanContext | None,
        trace_id: int,
        random: int,
        decision: Decision,
        sampled_attributes: Mapping[str, AttributeValue] | None,
        trace_state: TraceState | None,
    ) -> SpanRecord:
        """The record of a span the sampler decided on; `sampled_attributes` are its attributes
        as the sampler returned them."""
        flags = _FLAGS[decision is Decision.RECORD_AND_SAMPLE, random]
        context = SpanContext(trace_id, self._ids.generate_span_id(), False, flags, trace_state)
        recording = decision is not Decision.DROP
        if not recording:
            return SpanRecord(name, context, parent, kind, start, recording, {})
        if not self._limited:
            # Usually a read-only view of the attributes the sampler was given: a mappingproxy's
            # copy() is its mapping's (dict(view) would go key by key).
            copy = getattr(sampled_attributes, "copy", None)
            attrs = copy() if copy is not None else dict(sampled_attributes or {})
            if type(attrs) is not dict:
                attrs = dict(attrs)
            return SpanRecord(name, context, parent, kind, start, recording, attrs)
        lim = self._limits
        bounded = BoundedAttributes(
            lim.max_span_attributes, sampled_attributes, False, lim.max_span_attribute_length
        )
        events: BoundedList[Event] = BoundedList(lim.max_events)
        return SpanRecord(
            name, context, parent, kind, start, recording, bounded, events, UNSET, self._event_limits
        )

    def end(self, record: SpanRecord, end: int | None = None) -> None:
        """Hands a recording span to the processor; a dropped one just ends."""
        if not record.recording:
            return
        record.recording = False  # ended: a second end hands nothing over
        span = ReadableSpan(
            record.name,
            record.context,
            record.parent,
            self._resource,
            record.attributes,
            record.events,
            (),
            record.kind,
            self._info,
            record.status,
            record.start,
            end if end is not None else time_ns(),
            self._scope,
        )
        self._processor.on_end(span)


def _at_least(limit: int | None, n: int) -> bool:
    return limit is None or limit >= n
