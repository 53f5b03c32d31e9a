"""OS utilities of the bench's processes: CPU pinning and the event loop."""

from __future__ import annotations

import asyncio
import os


def pin(cpu: int | None) -> bool:
    """Pin this process to one CPU; False when it cannot (no such CPU, or no affinity support)."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        return False
    return True


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when it is installed (it is a dependency of infertap): the cheapest loop there is."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
