"""A low-frequency probe of the event loop's lag: how late a sleeping task wakes up.

Every `interval` seconds a task sleeps and measures how much later than asked it woke. A loop
busy with callbacks (or stalled in a GC pause or a blocking call) wakes it late; an idle loop
wakes it within the timer's resolution. One observation per interval, nothing per request.
Pure stdlib: the observation goes to a callback (the metrics observer's histogram).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopLagProbe:
    # Once a second: on an idle core each wake-up costs a few hundred microseconds of CPU (0.28 ms a
    # second at 0.5 s, measured), and a lag worth an alert lasts longer than that.
    def __init__(self, observe: Callable[[float], None], interval: float = 1.0) -> None:
        self.observe = observe
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="infertap-loop-lag")

    async def _run(self) -> None:
        perf, interval = time.perf_counter, self.interval
        while True:
            asked = perf() + interval
            await asyncio.sleep(interval)
            self.observe(max(0.0, perf() - asked))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
