"""Request ids: the client's X-Request-Id when it is a sane one, else a fresh one."""

from __future__ import annotations

import itertools
import uuid
from typing import Final

from proxy.core.asgi import Scope, header

MAX_REQUEST_ID = 128
_HEX3: Final = tuple(f"{i:03x}" for i in range(4096))


class RequestIds:
    """UUID-shaped request ids: a random per-process prefix and a counter.

    Unique across processes (the prefix) and within one (the counter), and an order of magnitude
    cheaper than uuid4() per request. UUID-shaped because some engines (llama-cpp-python's
    server) reject an X-Request-Id that does not parse as a UUID.
    """

    def __init__(self) -> None:
        prefix = uuid.uuid4().hex
        self._prefix = f"{prefix[:8]}-{prefix[8:12]}-4{prefix[13:16]}-{prefix[16:20]}-"
        self._next = itertools.count(int(prefix[20:], 16) & 0xFFFFFFFF).__next__

    def __call__(self, scope: Scope) -> str:
        given = header(scope, b"x-request-id")
        if given and len(given) <= MAX_REQUEST_ID and given.isprintable():
            return given
        n = self._next()
        # Four table rows of three hex digits each: a `:012x` format spec is a generic __format__
        # call (about 2,000 instructions) where the rest of this costs a few hundred.
        return (
            f"{self._prefix}{_HEX3[(n >> 36) & 0xFFF]}{_HEX3[(n >> 24) & 0xFFF]}"
            f"{_HEX3[(n >> 12) & 0xFFF]}{_HEX3[n & 0xFFF]}"
        )
