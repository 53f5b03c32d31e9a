"""The httptools client's answer headers (proxy/transport/h1_headers.py): a compiled class that is
not a Mapping subclass (mypyc cannot build one) but registered as one, so what the core and a
user's observer may do with a Mapping still works: case-insensitive lookups, the first of repeated
values (as aiohttp's), iteration, dict(), equality."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.transport.h1_headers import Headers

RAW = [
    (b"Content-Type", b"text/event-stream"),
    (b"X-Dup", b"first"),
    (b"x-dup", b"second"),
    (b"Retry-After", b"3"),
]


def test_the_headers_are_a_case_insensitive_mapping_with_the_first_value() -> None:
    h = Headers(RAW)
    assert isinstance(h, Mapping)
    assert h["content-type"] == h["CONTENT-TYPE"] == "text/event-stream"
    assert h.get("x-dup") == "first" and h.get("missing") is None and h.get("missing", "d") == "d"
    assert "Retry-After" in h and "nope" not in h and 3 not in h
    assert list(h) == ["content-type", "x-dup", "retry-after"] and len(h) == 3
    assert dict(h) == {"content-type": "text/event-stream", "x-dup": "first", "retry-after": "3"}
    assert list(h.items()) == list(dict(h).items()) and list(h.values()) == list(dict(h).values())
    assert h == dict(h) and h == Headers(RAW) and h != {"content-type": "x"}
