"""The scanner's fast path (one whole LF-framed event per read, judged with byte comparisons where
the engines write compact JSON) against its general path and the patterns alone: the same bytes out,
the same output counts, the same facts, for any events and any read boundaries.

The class of bugs is "the shortcut judges an event or a read differently from the long way" (one
found while writing it: a 1-byte read, in which `find` returns -1, passed for a whole event).
"""

from __future__ import annotations

import json
import os
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


@st.composite
def events(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["delta", "delta", "delta", "reasoning", "tool", "role", "usage", "comment"]))
    if kind == "comment":
        return b": keep-alive\n\n"
    delta: dict[str, object]
    if kind == "delta":
        delta = {"content": draw(st.sampled_from(["", "x", "hi there", '"content":"', "\\"]))}
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
    if kind != "usage" and draw(st.booleans()):
        obj["choices"][0]["finish_reason"] = "stop"  # type: ignore[index]
    if draw(st.booleans()) or kind == "usage":
        obj["usage"] = USAGE if kind == "usage" or draw(st.booleans()) else None
    compact = draw(st.booleans())
    text = json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj)
    return b"data: " + text.encode() + draw(st.sampled_from([b"\n\n", b"\n\n", b"\r\n\r\n"]))


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    body = b"".join(draw(st.lists(events(), min_size=1, max_size=15))) + b"data: [DONE]\n\n"
    # Cuts at event boundaries (a paced stream: one event a read) and anywhere (1-byte reads too).
    ends = [i + 2 for i in range(len(body)) if body.startswith(b"\n\n", i)]
    just_after = [e + 1 for e in ends if e < len(body)]  # a 1-byte read with nothing held
    anywhere = st.integers(0, len(body))
    at = st.sampled_from(ends) | st.sampled_from(just_after) if just_after else st.sampled_from(ends)
    cuts = draw(st.lists(at | anywhere, max_size=30))
    return body, sorted(set(cuts))


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
