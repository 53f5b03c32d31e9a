"""Each upstream's slots (`Pool`): at most `limit` requests to it at once, whatever the client.

Both implementations of the seam share this, so a full pool reads the same whichever runs: waiting
for a slot past `Timeouts.pool` is ErrorKind.POOL_TIMEOUT, infertap's own queue, never the
upstream's fault (and never part of the connect timeout, which would blame the upstream).
"""

from __future__ import annotations

import asyncio

from proxy.core.errors import ErrorKind, UpstreamError
from proxy.core.seam import Pool, Timeouts


class Slots:
    def __init__(self, default_limit: int) -> None:
        self.default_limit = default_limit
        self._slots: dict[Pool, asyncio.Semaphore] = {}

    async def acquire(self, pool: Pool, timeouts: Timeouts) -> asyncio.Semaphore:
        """The pool's semaphore, acquired: the caller releases it once the answer is let go."""
        slot = self._slots.get(pool)
        if slot is None:
            slot = self._slots[pool] = asyncio.Semaphore(pool.limit or self.default_limit)
        if not slot.locked():
            await slot.acquire()  # free: at once
            return slot
        try:
            async with asyncio.timeout(timeouts.pool):
                await slot.acquire()
        except TimeoutError:
            limit = pool.limit or self.default_limit
            raise UpstreamError(
                ErrorKind.POOL_TIMEOUT,
                None,
                f"had all {limit} of its connections busy for {timeouts.pool:g} s (pool timeout: raise "
                "its max_connections, or [timeouts] pool)",
            ) from None
        return slot
