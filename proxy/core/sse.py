"""Incremental scanner over a raw text/event-stream body.

Pure: bytes in, bytes out. It finds event boundaries across arbitrary upstream chunks,
tells which events carry output text, extracts the usage object, and can strip the
usage-only chunk and the `"usage":null` members that infertap's request for usage added.
Byte searches decide almost everything;
JSON is parsed only for the few events that need it (the first one, the usage one, and
any that carries a finish reason).
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson
from mypy_extensions import mypyc_attr

from proxy.core.errors import ErrorKind, UpstreamError
from proxy.core.stream_facts import StreamFacts, absorb_response, absorb_responses_event

# Substrings are looked for with bytes.find, never `in`: `sub in data` first tries `sub` as an
# integer (a byte value), and the TypeError it raises and clears costs more than the search (about
# 5,000 instructions each, once or twice an event).

# An event still incomplete past this many bytes ends the stream: it bounds what one stream holds
# (a 50 MB line took 140 MB), and it is how a stream that never writes a blank line (so cannot be
# framed into events) ends, with an error, instead of being held whole.
MAX_EVENT_BYTES = 8 * 1024 * 1024
# What a stream may send before its first output event (everything is held until then, so that a
# retry stays invisible to the client): a flood of comments or empty events ends the attempt.
MAX_HELD_BYTES = 8 * 1024 * 1024

# An event carries output when a text field holds a non-empty string, or a tool call starts or
# continues (a `tool_calls` list with an entry: some engines send `"tool_calls": []` with text).
# A literal `"content"` inside a JSON string is escaped (\"content\"), so it cannot match.
_OUTPUT = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning|refusal)"\s*:\s*"(?!")'
    rb'|"tool_calls"\s*:\s*\[\s*\{|"function_call"\s*:\s*\{'
)
# An answer event: output that is not reasoning (reasoning_content/reasoning deltas come first in a
# reasoning model's stream). Searched only until the first one is found.
_ANSWER = re.compile(
    rb'"(?:content|text|refusal)"\s*:\s*"(?!")'
    rb'|"(?:tool_calls|function_call)"\s*:\s*[\[{]'
)
# Responses API reasoning deltas: response.reasoning_text.delta, response.reasoning_summary_text.delta.
_RESPONSES_REASONING = re.compile(rb'"type"\s*:\s*"response\.reasoning')
# Anchored at a key found with bytes.find (a C memchr-speed scan): `match` at one position is
# far cheaper than `search` over every position.
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"')
_NONEMPTY_STRING = re.compile(rb'\s*:\s*"(?!")')
# The Responses API streams its output as `*.delta` events whose `delta` is a string (in chat
# completions `delta` is always an object, so this never matches there).
_DELTA_TEXT = re.compile(rb'"delta"\s*:\s*"(?!")')
# A top-level `"usage": null` member and what ends it. Where it can match: a `"` inside a JSON string
# is escaped (\"), so the bytes `usage"` (an unescaped quote right after the name) end a string, and
# one followed by `:` is a key, never a value.
_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null\s*(?=[,}])')
# A blank line: a line terminator (CRLF, LF or CR, the SSE standard's three) right after another.
# A CR is one terminator only when no LF follows it, else CRLF is: `a\r\nb` holds no blank line.
# A lone CR at the very end of the bytes searched counts as one (a CR-only stream's events are not
# held until the next read): if an LF follows, the next event starts with it, which a client reads
# as the rest of the CRLF. A CRLF stream's `\r\n\r` waits for its LF (_last_boundary).
_BLANK = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r)")
_DATA_PREFIX = re.compile(rb"^data: ?", re.MULTILINE)
_LINE_END = re.compile(rb"\r\n|\r|\n")
# A text's bytes up to its closing quote, where it has no escape and no line break (feed's shape):
# _text_end's pattern, where the module runs as Python.
_TEXT_RUN = re.compile(rb'[^"\\\r\n]*')
# Whether this module runs compiled (proxy/compiled/).
_COMPILED: Final = not __file__.endswith(".py")
# Texts that name a key the event checks look for: not learnt as a shape's (see _learn).
_KEY_TEXTS = frozenset({b"finish_reason", b"usage"})


def _text_end(data: bytes, start: int) -> int:
    """Where the text starting at `start` stops being a shape's text: its first quote, backslash,
    CR or LF, else the end of `data`. Compiled, _text_loop: a few instructions a byte where a
    pattern's `match` and `end` calls cost about 2,000 (a token's text is a few bytes, and this
    runs once a token); as Python, the pattern, which is the faster there."""
    if _COMPILED:
        return _text_loop(data, start)
    m = _TEXT_RUN.match(data, start)
    assert m is not None  # (a `*` pattern always matches)
    return m.end()


def _text_loop(data: bytes, start: int) -> int:
    """_text_end as a byte loop (its compiled form; feed's once-a-token paths call it directly)."""
    n = len(data)
    i = start
    while i < n:
        c = data[i]
        if c == 0x22 or c == 0x5C or c == 0x0A or c == 0x0D:
            return i
        i += 1
    return n


def event_data(event: bytes) -> bytes:
    """The joined `data:` field of one event (without the prefix)."""
    lines = [ln for ln in event.splitlines() if ln.startswith(b"data:")]
    if len(lines) == 1:
        line = lines[0]
        return line[6:] if line.startswith(b"data: ") else line[5:]
    return b"\n".join(_DATA_PREFIX.sub(b"", ln) for ln in lines)


def _last_boundary(buf: bytes | bytearray, start: int = 0, cr: int | None = None) -> int:
    """Index just past the last complete event in `buf` (searching from `start`), or 0. `cr`: where
    the caller found buf's first CR from `start` (-1: none), when it looked already."""
    if (buf.find(b"\r", start) if cr is None else cr) < 0:  # the common case, LF only: one C-speed search
        lf = buf.rfind(b"\n\n", start)
        return lf + 2 if lf >= 0 else 0
    end = last = 0
    for m in _BLANK.finditer(buf, start):
        last, end = end, m.end()
    if end == len(buf) and buf.endswith(b"\r\n\r"):
        # A CRLF stream's blank line, its LF still to come: waits for it, so that what follows
        # (the next event, or infertap's error) starts after the whole CRLF, as naive clients expect.
        # (A stream that ends there, mixing CRLF and a lone CR, is taken as cut.)
        return last
    return end


# Subclassed outside the compiled modules (proxy/compiled/).
@mypyc_attr(allow_interpreted_subclasses=True)
class SSEScanner:
    """Feed it upstream chunks; it returns the bytes to forward and how many output events they hold.

    Only complete events are forwarded: a client cannot act on half an event, and holding
    the tail back is what makes stripping a whole event possible.
    """

    __slots__ = (
        "_tail",
        "_strip_usage_only",
        "_native_null",
        "_usage_at",
        "_plain_at",
        "_shape_len",
        "_shape_head",
        "_shape_tail",
        "_shape_out",
        "_learns",
        "facts",
        "_max_event",
        "_held",
        "_max_held",
    )
    END = "[DONE]"  # what a complete stream ends with, for the message when it does not

    def __init__(
        self,
        strip_usage_only: bool = False,
        capture_chars: int = 0,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_held_bytes: int = MAX_HELD_BYTES,
    ) -> None:
        self._tail = bytearray()
        self._max_event = max_event_bytes
        # Bytes read before the first output event; -1 once there was one (the check then costs a
        # comparison per read).
        self._held = 0
        self._max_held = max_held_bytes
        self._strip_usage_only = strip_usage_only
        # Whether this upstream writes `"usage":null` unasked (decided at the first one seen).
        self._native_null: bool | None = None
        # Where the last output event's first `"usage"` is (-1: it has none, so there is nothing to
        # strip): _inspect's search, kept so that the strip does not search again.
        self._usage_at = 0
        # A stream's events mostly differ only in their text: what comes before it (id, model,
        # `"delta":{"content":"`) and after it (finish_reason, usage) is the same bytes each time.
        # The last plain output event's bytes before its text and from the text's closing quote on
        # (and that part as forwarded, where the strip changed it: else None) let feed judge the
        # next one by two comparisons and one pattern (see _learn). A shape that stops fitting is
        # dropped and learnt again, a few times at most, so a stream whose events all differ
        # (a per-chunk field after the text) costs a few failed comparisons, not one a token.
        self._shape_len = 0
        self._shape_head = b""
        self._shape_tail = b""
        self._shape_out: bytes | None = None
        self._learns = 4
        # Where the text of the event _inspect just judged starts, when it was a plain output
        # event (compact, nothing to parse); else 0.
        self._plain_at = 0
        self.facts = StreamFacts(capture_chars=capture_chars)

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        """The complete events now available (as sent, less what is stripped) and how many carry
        output. Raises UpstreamError when the stream breaks a limit (MAX_EVENT_BYTES, MAX_HELD_BYTES)."""
        h = self._shape_len
        if h and not self._tail:
            # A read that is one event of the last plain one's shape, nothing held before it:
            # _shaped's test written out (a frame is a sixth of this path's cost; change both).
            several = False
            if chunk.startswith(self._shape_head):
                if _COMPILED:
                    q = _text_loop(chunk, h)
                else:  # _text_end's pattern, without its frame (this runs once a token)
                    m = _TEXT_RUN.match(chunk, h)
                    assert m is not None  # (a `*` pattern always matches)
                    q = m.end()
                if q > h:
                    tail = self._shape_tail
                    if len(chunk) - q == len(tail) and chunk.endswith(tail):
                        self.facts.events += 1
                        rest = self._shape_out
                        return (chunk if rest is None else chunk[:q] + rest), 1
                    # Several events in one read (a fast stream), the first of the shape: the
                    # shape is kept for _feed_many, which tries it on each.
                    several = chunk[q : q + len(tail)] == tail
            if not several:
                self._shape_len = 0
        # A paced stream's every read after its first output: exactly one whole event, LF-framed,
        # nothing held before it. Judged here, two calls deep, not five (this runs once a token).
        if (
            self._held < 0
            and not self._tail
            # Its only LFs the two that end it (one `data:` line, as the engines write a chunk):
            # found by memchr, at half the cost of searching for the blank line. A one-byte chunk
            # without one finds -1 == 1 - 2: `len - 2 > 0` and the last byte rule it out.
            and chunk.find(b"\n") == len(chunk) - 2 > 0
            and chunk[-1] == 10
            and chunk.find(b"\r") < 0
        ):
            outputs, keep = self._inspect(chunk)
            if not keep:
                return b"", outputs
            out = chunk
            if self._strip_usage_only and not (outputs and self._usage_at < 0):
                out = self._without_null_usage(chunk)
            if self._plain_at and self._learns:
                self._learn(chunk, out)
            return out, outputs
        return self._feed_counted(chunk)

    def _shaped(self, chunk: bytes, start: int) -> int:
        """Where the event at `start` ends, when it is one of the shape kept (_learn): the same
        bytes before its text and after it, and a text without a quote, a backslash, a CR or an
        LF. It is then the one event that the long way would find there, judged as that one was.
        Else 0, and the shape is dropped (to be learnt again from the next plain event)."""
        h = self._shape_len
        if chunk[start : start + h] == self._shape_head:
            q = _text_end(chunk, start + h)
            tail = self._shape_tail
            end = q + len(tail)
            if q > start + h and chunk[q:end] == tail:
                return end
        self._shape_len = 0
        return 0

    def _learn(self, event: bytes, out: bytes) -> None:
        """Keeps the shape of `event`, a plain output event (one whole LF-framed event, compact
        non-empty text, nothing parsed), and `out`, what feed forwards of it, for the next read.

        An event with the same bytes before the text and from its closing quote on, and a text with
        no quote, backslash, CR or LF, is judged the same by _inspect and the strip: every `"` of it
        is one of the kept parts', so the first of each key they search for (`"content":"`,
        `"finish_reason"`, `"usage"`, `,"usage":null`) is where it is in this one, or is that
        event's text itself (`"usage"` as a text), which the `,` or `}` after its closing quote
        keeps from matching a pattern that needs a `:`. (So this one's text must not be such a
        name: the search found the text here, and would find the key after it there.) Its only
        LFs are the two that end it, as this one's. The state they also read only moves one way
        (events counted, the answer seen, the text captured, the upstream's own nulls decided)."""
        h = self._plain_at
        self._plain_at = 0
        q = _text_end(event, h)
        if event[q] != 0x22 or event[q + 1] not in b",}":  # a backslash, or not a string's end
            return
        if event[h:q] in _KEY_TEXTS:  # `"content":"finish_reason"` hid a finish reason after it
            return
        rest = None
        if out is not event:
            if out[:q] != event[:q]:  # the strip cut before the text: not kept
                return
            rest = out[q:]
        self._learns -= 1
        self._shape_len = h
        self._shape_head = event[:h]
        self._shape_tail = event[q:]
        self._shape_out = rest

    def _feed_counted(self, chunk: bytes) -> tuple[bytes, int]:
        """feed's general case, counting what is held before the first output event."""
        if self._held >= 0:
            out, outputs = self._feed(chunk)
            if outputs:
                self._held = -1
            else:
                self._held += len(chunk)
                if self._held > self._max_held:
                    raise UpstreamError(
                        ErrorKind.UPSTREAM_5XX,
                        None,
                        f"sent more than {self._max_held} bytes without an output event",
                    )
            return out, outputs
        return self._feed(chunk)

    def _feed(self, chunk: bytes) -> tuple[bytes, int]:
        if self._tail:
            chunk = self._join(chunk)
            if not chunk:
                return b"", 0
            end = len(chunk)
            cr = chunk.find(b"\r")
        else:
            cr = chunk.find(b"\r")  # once: _last_boundary and the one-event check both need it
            end = _last_boundary(chunk, 0, cr)
            if end == 0:
                self._hold(chunk)
                return b"", 0
            if end < len(chunk):
                self._hold(chunk[end:])
                chunk = chunk[:end]
        if (cr < 0 or cr >= end) and chunk.find(b"\n\n") + 2 == end:
            # The common case: exactly one event in this chunk (and no CR in it).
            outputs, keep = self._inspect(chunk)
            if not keep:
                return b"", outputs
            if self._strip_usage_only and not (outputs and self._usage_at < 0):
                chunk = self._without_null_usage(chunk)
            return chunk, outputs
        return self._feed_many(chunk, 0 <= cr < end)

    def _join(self, chunk: bytes) -> bytes:
        """Appends to a held partial event; returns the complete events, if any, now available.

        Only the new bytes (and the 3 before them, where a separator may straddle) are searched,
        so one huge event arriving in many pieces costs linear time, not quadratic.
        """
        tail = self._tail
        start = max(0, len(tail) - 3)
        tail += chunk
        end = _last_boundary(tail, start)
        if end == 0:
            self._hold(b"")
            return b""
        complete = bytes(tail[:end])
        del tail[:end]
        return complete

    def _hold(self, part: bytes) -> None:
        """Keeps `part` (the start of an incomplete event), within MAX_EVENT_BYTES."""
        tail = self._tail
        tail += part
        if len(tail) > self._max_event:
            tail.clear()
            raise UpstreamError(
                ErrorKind.UPSTREAM_5XX,
                None,
                f"sent more than {self._max_event} bytes without the blank line that ends an event",
            )

    def _feed_many(self, chunk: bytes, cr: bool) -> tuple[bytes, int]:
        """Each whole event of `chunk` judged; `cr`: whether `chunk` holds a CR (_feed looked)."""
        outputs = 0
        start = 0
        edited: list[tuple[int, int, bytes]] = []  # (start, end, what replaces them)
        strip = self._strip_usage_only
        # `chunk` is whole events. Each event's end is found as it comes (not all first): an event
        # of the shape kept ends where its kept part does, without a search.
        size = len(chunk)
        while start < size:
            if self._shape_len:
                if self._shape_out is None:
                    # A run of events of the shape kept, nothing to cut from them (a fast stream's
                    # reads are mostly this): _shaped's test in a loop of its own, without a call
                    # or an attribute lookup per event. The first that does not fit goes on below.
                    head = self._shape_head
                    h = len(head)
                    tail = self._shape_tail
                    t = len(tail)
                    run = 0
                    match = _TEXT_RUN.match
                    while chunk[start : start + h] == head:
                        if _COMPILED:
                            q = _text_loop(chunk, start + h)
                        else:  # as in feed
                            q = match(chunk, start + h).end()  # type: ignore[union-attr]  # `*`: always
                        if q == start + h or chunk[q : q + t] != tail:
                            break
                        start = q + t
                        run += 1
                    if run:
                        self.facts.events += run
                        outputs += run
                        if start >= size:
                            break
                    # The event at `start` failed _shaped's own test: it takes the long way below,
                    # and the shape is dropped, as _shaped drops it.
                    self._shape_len = 0
                else:
                    end = self._shaped(chunk, start)
                    if end:
                        self.facts.events += 1
                        outputs += 1
                        edited.append((end - len(self._shape_tail), end, self._shape_out))
                        start = end
                        continue
            if cr:
                m = _BLANK.search(chunk, start)
                end = size if m is None else m.end()
            else:
                end = chunk.find(b"\n\n", start) + 2
                if end == 1:
                    end = size
            event = chunk[start:end]
            n, keep = self._inspect(event)
            outputs += n
            if not keep:
                edited.append((start, end, b""))
                start = end
                continue
            bare = event
            if strip and not (n and self._usage_at < 0):
                bare = self._without_null_usage(event)
                if bare is not event:
                    edited.append((start, end, bare))
            # A shape is learnt as feed learns one, from an event whose only LFs end it and in
            # bytes without a CR (a `\r\n\r` end would wait for its LF at the end of a read).
            if self._plain_at and self._learns and not cr and event.find(b"\n") == len(event) - 2:
                self._learn(event, bare)
            start = end
        if not edited:
            return chunk, outputs
        parts = []
        pos = 0
        for a, b, replacement in edited:
            parts.append(chunk[pos:a])
            parts.append(replacement)
            pos = b
        parts.append(chunk[pos:])
        return b"".join(parts), outputs

    def _without_null_usage(self, event: bytes) -> bytes:
        """The event without the top-level `"usage":null` that asking for usage added (OpenAI and
        vLLM write it on every chunk then), with the comma that separated it; the same object when
        there is none. Bytes are cut, never re-serialized: everything else stays as the engine wrote
        it. The top-level member is the last `"usage": null` (nested objects come before it: the
        engines write `usage` after `choices`). An engine that writes every field, null or not,
        writes it unasked (SGLang: its chunks carry `matched_stop`): there nothing was added."""
        if self._native_null:
            return event
        i = event.rfind(b',"usage":null')
        if i >= 0 and event[i + 13] in b",}":  # compact, after another member: OpenAI's and vLLM's
            if self._native_null is None:
                self._native_null = event.find(b'"matched_stop"') >= 0
                if self._native_null:
                    return event
            return event[:i] + event[i + 13 :]
        i = event.rfind(b'"usage"')
        m = None
        while i >= 0:
            m = _USAGE_NULL.match(event, i)
            if m is not None:
                break
            i = event.rfind(b'"usage"', 0, i)  # a string's end (`..\"usage"`), or not null
        if m is None:
            return event
        if self._native_null is None:
            self._native_null = event.find(b'"matched_stop"') >= 0
            if self._native_null:
                return event
        k = i - 1
        while k >= 0 and event[k] in b" \t":
            k -= 1
        if k >= 0 and event[k] == 0x2C:  # `, "usage":null`: a later member, its comma goes with it
            return event[:k] + event[m.end() :]
        if k >= 0 and event[k] == 0x7B:  # `{"usage":null, ...`: the first member, the comma after it
            end = m.end()
            if event[end] == 0x2C:
                end += 1
                while end < len(event) and event[end] in b" \t":
                    end += 1
            return event[: k + 1] + event[end:]
        return event

    def flush(self) -> bytes:
        """Bytes left after the upstream's last complete event (an unterminated event). The relay
        never forwards them: a stream that ends there was cut mid-event, the SSE standard has
        clients discard such a fragment, and an error event glued onto it would be garbage."""
        tail = bytes(self._tail)
        self._tail.clear()
        return tail

    def _inspect(self, event: bytes) -> tuple[int, bool]:
        """(1 if the event carries output else 0, whether to forward it)."""
        facts = self.facts
        facts.events += 1
        self._plain_at = 0
        # A compact non-empty `"content":"` (how OpenAI, vLLM and SGLang write a delta) is output
        # and an answer, without a pattern; anything else takes the patterns.
        i = event.find(b'"content":"')
        text = i + 11
        # (The event ends with its blank line, so the byte after the pattern exists.)
        compact = i >= 0 and event[text] != 0x22
        if compact or _carries_output(event):
            if not facts.answered:
                facts.answered = compact or _carries_answer(event)
            # Per output event, so the checks are written out (each _has is a call more): the
            # first event, text to capture, a finish reason, usage. A `:null` (every chunk of
            # OpenAI's and vLLM's has both, null) is told apart by comparing a slice: in Python
            # 3.11 a bytes method with arguments (find, startswith) costs about 1,200 instructions
            # for its argument parsing alone, a slice and a comparison a fifth of that.
            u = self._usage_at = event.find(b'"usage"')
            if (
                facts.events == 1
                or facts.text_chars < facts.capture_chars
                or (
                    (i := event.find(b'"finish_reason"')) >= 0
                    and event[i + 15 : i + 20] != b":null"
                    and _FINISH.match(event, i) is not None
                )
                or (u >= 0 and event[u + 7 : u + 12] != b":null" and _USAGE.match(event, u) is not None)
            ):
                self._parse(event)
            elif compact:
                self._plain_at = text
            return 1, True
        if event.find(b"[DONE]") >= 0 and event_data(event).strip() == b"[DONE]":
            facts.done = True
            return 0, True
        if event.find(b'"error"') >= 0:
            facts.error_events += 1
            return 0, True
        if _has(event, b'"usage"', _USAGE):
            self._parse(event)
            if self._strip_usage_only and _EMPTY_CHOICES.search(event) is not None:
                return 0, False
            return 0, True
        if facts.events == 1 or _has(event, b'"finish_reason"', _FINISH):
            self._parse(event)
        return 0, True

    def _parse(self, event: bytes) -> None:
        try:
            obj = orjson.loads(event_data(event))
        except orjson.JSONDecodeError:
            return
        if isinstance(obj, dict):
            self._absorb(obj)

    def _absorb(self, obj: dict[str, Any]) -> None:
        absorb_response(self.facts, obj)


class ResponsesScanner(SSEScanner):
    """The Responses API's stream (POST /v1/responses): typed events and no `data: [DONE]`.

    Output events are the `*.delta` events with a non-empty string delta, judged by a byte
    search as in chat. The handful of other events a response has (created, item added and
    done, completed) are parsed: `response.completed` or `response.incomplete` carries the usage
    and ends the stream; `response.failed` and `error` are error events.
    """

    __slots__ = ()
    END = "response.completed"

    def _inspect(self, event: bytes) -> tuple[int, bool]:
        facts = self.facts
        facts.events += 1
        if _has(event, b'"delta"', _DELTA_TEXT):
            if not facts.answered:
                facts.answered = not _has(event, b'"type"', _RESPONSES_REASONING)
            if facts.wants_text():
                self._parse(event)
            return 1, True
        self._parse(event)
        return 0, True

    def _absorb(self, obj: dict[str, Any]) -> None:
        absorb_responses_event(self.facts, obj)


def _carries_output(event: bytes) -> bool:
    # Fast path for the common chat delta; everything else takes the full pattern.
    i = event.find(b'"content"')
    if i >= 0 and _NONEMPTY_STRING.match(event, i + 9) is not None:
        return True
    return _OUTPUT.search(event) is not None


def _carries_answer(event: bytes) -> bool:
    i = event.find(b'"content"')
    if i >= 0 and _NONEMPTY_STRING.match(event, i + 9) is not None:
        return True
    return _ANSWER.search(event) is not None


def _has(event: bytes, key: bytes, pattern: re.Pattern[bytes]) -> bool:
    """`pattern` (which starts with `key`) matches at the first occurrence of `key`."""
    i = event.find(key)
    return i >= 0 and pattern.match(event, i) is not None


def split_comments(events: bytes) -> tuple[bytes, bytes]:
    """(the comment-only events in `events`, the rest), each in order: `events` is complete events,
    as `SSEScanner.feed` returns them. A comment-only event is one whose every line starts with `:`
    (an upstream's `: keep-alive`): no client acts on it, so it may go out before the events held."""
    if events.find(b":") < 0:
        return b"", events
    comments: list[bytes] = []
    rest: list[bytes] = []
    start = 0
    for end in _event_ends(events):
        event = events[start:end]
        start = end
        lines = _LINE_END.split(event)
        if event[:1] == b":" and all(line[:1] == b":" for line in lines if line):
            comments.append(event)
        else:
            rest.append(event)
    if start < len(events):
        rest.append(events[start:])
    return b"".join(comments), b"".join(rest)


def _event_ends(chunk: bytes) -> list[int]:
    """Offsets just past each event separator in `chunk`."""
    if chunk.find(b"\r") >= 0:
        return [m.end() for m in _BLANK.finditer(chunk)]
    ends = []
    i = chunk.find(b"\n\n")
    while i >= 0:
        ends.append(i + 2)
        i = chunk.find(b"\n\n", i + 2)
    return ends
