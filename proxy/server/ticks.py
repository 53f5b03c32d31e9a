"""uvicorn's server, waking once a second when idle instead of ten times.

uvicorn's main loop sleeps 0.1 s at a time, to renew the `Date` header once a second and to see
`should_exit` soon after a signal sets it. On an idle core each wake-up is a few hundred
microseconds of CPU (the loop's timer, the task, cold caches): infertap idle cost 2.0 ms of CPU a
second, ten times what the requests of a quiet hour need, and a tenth of the CPU `infertap bench`
counts for a paced stream one at a time. This one sleeps until the next second begins (so `Date`
turns with the wall clock, not up to a second late), and is woken at once when `should_exit` is
set, whoever sets it (uvicorn's signal handler, the drain, a test): a shutdown starts as soon as
it did.

Built on uvicorn's `main_loop`/`on_tick` (pinned: pyproject.toml; tests/test_ticks.py fails should
they change).
"""

from __future__ import annotations

import asyncio
import time

import uvicorn

# The main loop's tick: it sleeps until the next whole multiple of this on the wall clock. Each
# tick renews the Date header, which has whole seconds.
TICK_S = 1.0


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        # Before uvicorn's __init__, whose `should_exit = False` goes through the property.
        self._exit = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Future[None] | None = None
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        loop = self._loop
        if value and loop is not None:
            # From a signal handler or another thread as often as from the loop itself.
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop has closed: nothing is waiting
                pass

    def _wake(self) -> None:
        woken = self._woken
        if woken is not None and not woken.done():
            woken.set_result(None)

    async def main_loop(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # every tick a whole second's: on_tick renews Date
            self._woken = woken = loop.create_future()
            if not self._exit:
                delay = TICK_S - time.time() % TICK_S
                handle = loop.call_later(delay, self._wake)
                try:
                    await woken
                finally:
                    handle.cancel()
            self._woken = None
            should_exit = await self.on_tick(counter)
