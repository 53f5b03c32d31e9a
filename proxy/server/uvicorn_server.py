"""uvicorn's server, whose main loop sleeps until it is told to exit instead of waking ten times
a second.

uvicorn's main loop sleeps 0.1 s at a time, to renew the `Date` header once a second and to see
`should_exit` soon after a signal sets it. On an idle core each wake-up is a few hundred
microseconds of CPU (the loop's timer, the task, cold caches): infertap idle cost 2.1 ms of CPU a
second (0.3 ms now), a sixth of the CPU `infertap bench` counted for a paced stream one at a time.
Here the `Date` header is renewed by the request that finds it a second old (`renew_date`, called
as a request's head is complete, by a connection's RequestHead once a second, and before a 400),
and the main loop is woken at once when `should_exit` is set, whoever sets it (uvicorn's signal
handler, the drain, a test): a shutdown starts as soon as it did.

Built on uvicorn's `main_loop`/`on_tick` and its `ServerState.default_headers` (pinned:
pyproject.toml; tests/test_uvicorn_server.py fails should they change).
"""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from typing import Any

import uvicorn


def renew_date(state: Any, config: uvicorn.Config) -> None:
    """uvicorn's default headers (`Date`, its `server` header if on, `--header`s) as on_tick sets
    them, renewed when the second has turned since they were made."""
    now = time.time()
    second = int(now)
    if getattr(state, "date_second", None) == second:
        return
    state.date_second = second
    date = [(b"date", formatdate(now, usegmt=True).encode())] if config.date_header else []
    state.default_headers = date + config.encoded_headers


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
        should_exit = await self.on_tick(0)
        while not should_exit:
            self._woken = woken = loop.create_future()
            if not self._exit:
                await woken
            self._woken = None
            # A count that is not a multiple of 10: uvicorn's on_tick leaves Date to renew_date.
            should_exit = await self.on_tick(1)
