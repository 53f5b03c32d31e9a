"""Reading a relayed SSE body in tests, strictly: as the SSE standard has a client read it."""

from __future__ import annotations

import re


def sse_events(body: bytes) -> list[bytes]:
    """The data of each event as the SSE standard has a client read it; fails on a body that ends
    inside an event."""
    lines = re.split(rb"\r\n|\r|\n", body)
    assert lines[-1] == b"", f"ends mid-line: {body[-80:]!r}"
    events, data = [], []
    for line in lines[:-1]:
        if not line:
            if data:
                events.append(b"\n".join(data))
            data = []
        elif line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
    assert not data, f"ends inside an event: {body[-80:]!r}"
    return events
