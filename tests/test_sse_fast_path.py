"""The scanner's fast path (one whole LF-framed event per read, judged with byte comparisons where
the engines write compact JSON) against its general path and the patterns alone: the same bytes out,
the same output counts, the same facts, for any events and any read boundaries.

The class of bugs is "the shortcut judges an event or a read differently from the long way" (one
found while writing it: a 1-byte read, in which `find` returns -1, passed for a whole event).
The shortest way, an event judged by the shape of the last one (the same bytes before and after its
text), is drawn against texts that name the keys searched for, end in a comma or a backslash, or
hold a quote or a line break, and against events with a field that changes after the text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.core import sse
from proxy.core.sse import SSEScanner

EXAMPLES = int(os.environ.get("INFERTAP_SSE_EXAMPLES", "25"))


class PatternsOnly(SSEScanner):
    """The oracle: every read through the general path, every event judged by the patterns alone."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        return self._feed_counted(chunk)

    def _inspect(self, event: bytes) -> tuple[int, bool]:
        facts = self.facts
        facts.events += 1
        if sse._carries_output(event):
            if not facts.answered:
                facts.answered = sse._carries_answer(event)
            if (
                facts.events == 1
                or facts.text_chars < facts.capture_chars
                or sse._has(event, b'"finish_reason"', sse._FINISH)
                or sse._has(event, b'"usage"', sse._USAGE)
            ):
                self._parse(event)
            return 1, True
        facts.events -= 1  # counted again there
        return super()._inspect(event)  # not output: the same code either way


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
# Texts, as most are (short, plain), and as a shape's judgement must not be fooled by: the keys it
# looks for, a comma or backslash at the end, a quote, a line break (both escaped in the JSON).
TEXTS = ["", "x", "x", "hi there", '"content":"', "\\", "usage", "finish_reason", "a,", 'a"', "a\n", "\r"]


# How a stream writes its events, drawn once a stream (an engine writes every chunk alike), each
# event keeping it five times in six: so that runs of one shape, the fast path's case, are common.
KEEP = (True, True, True, True, True, False)
STYLE = st.fixed_dictionaries(
    {
        "finish": st.sampled_from([None, None, "stop"]),
        "usage": st.sampled_from(["absent", "null", "object"]),
        # A field after the text (OpenAI's obfuscation, which changes each chunk: here, now and then).
        "obfuscation": st.sampled_from([None, None, "a", "usage", '"usage":null']),
        "compact": st.booleans(),
        "end": st.sampled_from([b"\n\n", b"\n\n", b"\r\n\r\n"]),
    }
)


KINDS = ["delta"] * 6 + ["reasoning", "tool", "role", "usage", "comment"]


@st.composite
def events(
    draw: st.DrawFn, style: Mapping[str, object], keep: tuple[bool, ...] = KEEP, kinds: list[str] = KINDS
) -> bytes:
    def kept(name: str) -> object:
        return style[name] if draw(st.sampled_from(keep)) else draw(STYLE)[name]

    kind = draw(st.sampled_from(kinds))
    if kind == "comment":
        return b": keep-alive\n\n"
    delta: dict[str, object]
    if kind == "delta":
        delta = {"content": draw(st.sampled_from(TEXTS))}
    elif kind == "reasoning":
        delta = {"reasoning_content": "think", "content": draw(st.sampled_from(["", None]))}
    elif kind == "tool":
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    else:
        delta = {"role": "assistant", "content": ""}
    obj: dict[str, object] = {
        "id": "c1",
        "model": "m",
        "choices": [] if kind == "usage" else [{"index": 0, "delta": delta, "finish_reason": None}],
    }
    if kind != "usage":
        obj["choices"][0]["finish_reason"] = kept("finish")  # type: ignore[index]
    usage = "object" if kind == "usage" else kept("usage")
    if usage != "absent":
        obj["usage"] = USAGE if usage == "object" else None
    obfuscation = kept("obfuscation")
    if obfuscation is not None:
        obj["obfuscation"] = obfuscation
    text = json.dumps(obj, separators=(",", ":")) if kept("compact") else json.dumps(obj)
    return b"data: " + text.encode() + kept("end")  # type: ignore[operator]


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    style = draw(STYLE)
    body = b"".join(draw(st.lists(events(style), min_size=1, max_size=15))) + b"data: [DONE]\n\n"
    # Cuts at event boundaries (a paced stream: one event a read) and anywhere (1-byte reads too).
    ends = [i + 2 for i in range(len(body)) if body.startswith(b"\n\n", i)]
    just_after = [e + 1 for e in ends if e < len(body)]  # a 1-byte read with nothing held
    anywhere = st.integers(0, len(body))
    at = st.sampled_from(ends) | st.sampled_from(just_after) if just_after else st.sampled_from(ends)
    cuts = draw(st.lists(at | anywhere, max_size=30))
    if draw(st.booleans()):  # a paced stream's reads: every event alone (and some cut anyway)
        cuts += ends
    return body, sorted(set(cuts))


@st.composite
def runs(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """A stream of deltas, nearly all of one shape, each event read alone (paced) or not."""
    style = draw(STYLE)
    deltas = events(style, keep=(True,) * 7 + (False,), kinds=["delta"])
    body = b"".join(draw(st.lists(deltas, min_size=2, max_size=20))) + b"data: [DONE]\n\n"
    ends = [i + 2 for i in range(len(body)) if body.startswith(b"\n\n", i)]
    if draw(st.booleans()):  # a zero-delay stream's reads: several events each
        return body, sorted(set(draw(st.lists(st.sampled_from(ends), max_size=len(ends)))))
    return body, ends


def _run(scanner: SSEScanner, body: bytes, cuts: list[int]) -> tuple[bytes, list[int]]:
    out, counts, pos = [], [], 0
    for cut in [*cuts, len(body)]:
        data, n = scanner.feed(body[pos:cut])
        out.append(data)
        counts.append(n)
        pos = cut
    return b"".join(out) + scanner.flush(), counts


@settings(max_examples=EXAMPLES * 8, deadline=None)
@given(stream=streams(), strip=st.booleans())
@example(
    stream=(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' * 2 + b"data: [DONE]\n\n", [48, 49]),
    strip=False,
)
def test_the_fast_path_agrees_with_the_patterns(stream: tuple[bytes, list[int]], strip: bool) -> None:
    body, cuts = stream
    fast, slow = SSEScanner(strip_usage_only=strip), PatternsOnly(strip_usage_only=strip)
    assert _run(fast, body, cuts) == _run(slow, body, cuts)
    assert asdict(fast.facts) == asdict(slow.facts)


class Judged(SSEScanner):
    """Counts the events judged the long way (_inspect)."""

    __slots__ = ("judged",)

    def __init__(self, strip_usage_only: bool = False) -> None:
        super().__init__(strip_usage_only=strip_usage_only)
        self.judged = 0

    def _inspect(self, event: bytes) -> tuple[int, bool]:
        self.judged += 1
        return super()._inspect(event)


def _delta(text: str, after: str = "", before: str = "", stop: bool = False) -> bytes:
    finish = '"stop"' if stop else "null"
    return (
        f'data: {{{before}"id":"c1","choices":[{{"index":0,"delta":{{"content":"{text}"}},'
        f'"finish_reason":{finish}}}]{after}}}\n\n'
    ).encode()


def test_a_stream_of_one_shape_is_judged_the_long_way_twice() -> None:
    # The first event (parsed) and the second (its shape learnt); the rest by their shape, with the
    # usage null that infertap asked for cut from each.
    scanner = Judged(strip_usage_only=True)
    reads = [_delta(t, ',"usage":null') for t in ("a", "b", "cd", "e f", "g")]
    out = [scanner.feed(r) for r in reads]
    assert out == [(_delta(t), 1) for t in ("a", "b", "cd", "e f", "g")]
    assert scanner.judged == 2
    assert scanner.facts.events == 5
    # A text with an escape takes the long way, and is no shape to learn; the next plain one is.
    assert scanner.feed(_delta('q\\"u')) == (_delta('q\\"u'), 1)
    assert [scanner.feed(_delta(t)) for t in ("h", "i", "j")] == [(_delta(t), 1) for t in ("h", "i", "j")]
    assert scanner.judged == 4


def test_a_stream_whose_events_all_differ_stops_learning() -> None:
    scanner = Judged()
    reads = [_delta("t", f',"obfuscation":"{i}"') for i in range(40)]
    assert [scanner.feed(r) for r in reads] == [(r, 1) for r in reads]
    assert scanner.judged == 40
    assert scanner._learns == 0  # four shapes learnt, each missed once, then none
    assert scanner._shape_len == 0  # and none tried


def test_a_fast_stream_keeps_its_shape_across_reads_of_several_events() -> None:
    scanner = Judged(strip_usage_only=True)
    reads = [b"".join(_delta(t, ',"usage":null') for t in "abc")] * 5
    assert [scanner.feed(r) for r in reads] == [(b"".join(_delta(t) for t in "abc"), 3)] * 5
    assert scanner.judged == 2  # a (parsed) and b (learnt); then 13 by their shape
    assert scanner._learns == 3


def _events(*events: bytes) -> tuple[bytes, list[int]]:
    body = b"".join(events) + b"data: [DONE]\n\n"
    return body, [sum(map(len, events[:i])) for i in range(1, len(events) + 1)]


@settings(max_examples=EXAMPLES * 20, deadline=None)
@given(stream=runs(), strip=st.booleans())
# The text of the event whose shape is kept names a key: there the search found the text, and the
# next event's key (a finish reason) went unseen.
# The text of an event whose shape is learnt names a key: there the search found the text, and the
# next event's key (a finish reason) would go unseen.
@example(stream=_events(*(_delta(t, stop=True) for t in ("a", "finish_reason", "c"))), strip=False)
# An empty text, of the learnt shape: no output.
@example(stream=_events(_delta("a"), _delta("b"), _delta("c"), _delta("")), strip=False)
# The usage null infertap asked for, written before the text: the strip cuts there, not after it.
@example(stream=_events(*(_delta(t, before='"usage":null,') for t in "abcd")), strip=True)
def test_runs_of_one_shape_agree_with_the_patterns(stream: tuple[bytes, list[int]], strip: bool) -> None:
    body, cuts = stream
    fast, slow = Judged(strip_usage_only=strip), PatternsOnly(strip_usage_only=strip)
    assert _run(fast, body, cuts) == _run(slow, body, cuts)
    assert asdict(fast.facts) == asdict(slow.facts)


# Bytes where the four that end a text (quote, backslash, LF, CR) are common, among others.
_TEXT_BYTES = st.lists(
    st.one_of(st.sampled_from([0x22, 0x5C, 0x0A, 0x0D]), st.integers(0, 255)), max_size=30
).map(bytes)


@given(_TEXT_BYTES, st.integers(min_value=0, max_value=30))
def test_the_text_loop_ends_where_the_text_pattern_does(data: bytes, start: int) -> None:
    # Compiled, _text_end is the byte loop; as Python, the pattern itself: the loop must agree
    # (tested directly, so that it is tested whichever way the suite runs).
    start = min(start, len(data))
    m = sse._TEXT_RUN.match(data, start)
    assert m is not None and sse._text_loop(data, start) == sse._text_end(data, start) == m.end()
