"""The SSE scanner: boundaries across arbitrary chunks, output detection, usage, stripping."""

from __future__ import annotations

import json

import pytest

from proxy.core.sse import SSEScanner


def chunk(delta: dict[str, object], finish: str | None = None, spaced: bool = False) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    text = json.dumps(obj) if spaced else json.dumps(obj, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


USAGE = (
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = (
    chunk({"role": "assistant", "content": ""})
    + chunk({"content": "Hel"})
    + chunk({"content": "lo"})
    + chunk({}, "stop")
    + USAGE
    + DONE
)


def feed_all(scanner: SSEScanner, pieces: list[bytes]) -> tuple[bytes, int]:
    out, outputs = b"", 0
    for p in pieces:
        o, n = scanner.feed(p)
        out += o
        outputs += n
    return out + scanner.flush(), outputs


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_any_split_gives_the_same_bytes_and_counts(size: int) -> None:
    scanner = SSEScanner()
    out, outputs = feed_all(scanner, [STREAM[i : i + size] for i in range(0, len(STREAM), size)])
    assert out == STREAM and outputs == 2
    f = scanner.facts
    assert f.done and f.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert f.response_id == "c1" and f.response_model == "m" and f.finish_reasons == ["stop"]


def test_crlf_separators() -> None:
    crlf = STREAM.replace(b"\n\n", b"\r\n\r\n")
    for size in (1, 5, len(crlf)):
        scanner = SSEScanner()
        out, outputs = feed_all(scanner, [crlf[i : i + size] for i in range(0, len(crlf), size)])
        assert out == crlf and outputs == 2 and scanner.facts.done


def test_usage_only_chunk_is_stripped_only_when_asked() -> None:
    out, _ = feed_all(SSEScanner(strip_usage_only=True), [STREAM])
    assert out == STREAM.replace(USAGE, b"")
    out, _ = feed_all(SSEScanner(strip_usage_only=True), [STREAM[: -len(DONE)], DONE])
    assert USAGE not in out


@pytest.mark.parametrize(
    ("event", "is_output"),
    [
        (chunk({"role": "assistant", "content": ""}), False),
        (chunk({"role": "assistant"}), False),
        (chunk({"content": None}), False),
        (chunk({"content": "x"}), True),
        (chunk({"content": "x"}, spaced=True), True),  # llama.cpp writes `"content": "x"`
        (chunk({"content": 'say \\"content\\": \\"hi'}), True),
        (chunk({"reasoning_content": "think"}), True),
        (chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}), True),
        (b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n', True),
        (b'data: {"choices":[{"index":0,"text":"","finish_reason":"stop"}]}\n\n', False),
        (b": keep-alive comment\n\n", False),
        (b'data: {"error":{"message":"boom"}}\n\n', False),
    ],
)
def test_output_detection(event: bytes, is_output: bool) -> None:
    scanner = SSEScanner()
    out, outputs = scanner.feed(event)
    assert out == event and outputs == int(is_output)


def test_escaped_key_inside_text_is_not_an_output() -> None:
    # The text of a role-only chunk's neighbour mentions "content": it must not count twice.
    event = chunk({"role": "assistant", "content": "", "note": 'a "content": "x" inside a string'})
    assert SSEScanner().feed(event)[1] == 0


def test_error_events_are_counted_and_relayed() -> None:
    scanner = SSEScanner()
    event = b'data: {"error":{"message":"boom","type":"server_error"}}\n\n'
    assert scanner.feed(event) == (event, 0)
    assert scanner.facts.error_events == 1


def test_huge_event_in_many_pieces() -> None:
    event = chunk({"content": "x" * 2_000_000})
    scanner = SSEScanner()
    out, outputs = feed_all(scanner, [event[i : i + 65536] for i in range(0, len(event), 65536)])
    assert out == event and outputs == 1


def test_capture_collects_text_up_to_the_cap() -> None:
    scanner = SSEScanner(capture_chars=4)
    feed_all(scanner, [STREAM])
    assert "".join(scanner.facts.text) == "Hell"
