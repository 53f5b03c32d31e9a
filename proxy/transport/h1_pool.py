"""An origin's kept-alive connections (scheme, host, port; through a proxy or not): the newest
reused first (LIFO: the connections the upstream most likely still keeps), and closed once unused
for KEEPALIVE_S, before a typical server's 5 s keep-alive closes them under us (as aiohttp's
`keepalive_timeout` here). One timer per origin sweeps them: none per request."""

from __future__ import annotations

import asyncio

from proxy.transport.h1_connection import H1Connection

KEEPALIVE_S = 4.0


class IdleConnections:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.conns: list[H1Connection] = []  # oldest first
        self._timer: asyncio.TimerHandle | None = None

    def take(self) -> H1Connection | None:
        conns = self.conns
        while conns:
            conn = conns.pop()
            if conn.usable():
                if not conns and self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                return conn
        return None

    def put(self, conn: H1Connection) -> None:
        self.conns.append(conn)
        self._arm()

    def _arm(self) -> None:
        if self._timer is None and self.conns:
            self._timer = self.loop.call_at(self.conns[0].idle_since + KEEPALIVE_S, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        conns = self.conns
        limit = self.loop.time() - KEEPALIVE_S
        stale = 0
        while stale < len(conns) and conns[stale].idle_since <= limit:
            conns[stale].close()
            stale += 1
        del conns[:stale]
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for conn in self.conns:
            conn.close()
        self.conns.clear()
