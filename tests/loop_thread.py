"""An asyncio server's loop run in a thread for a test, and its orderly end.

Stopping such a loop while one of its connection handlers is still waiting (on a connection the
client keeps alive: infertap's pool keeps them) leaves the handler's coroutine pending in a closed
loop; the garbage collector finds it later, in whatever test runs then, and pytest reports the
"Task was destroyed but it is pending" there. `stop` cancels every handler and lets each one's
`finally` run while the loop still runs.
"""

from __future__ import annotations

import asyncio
import threading


def start(loop: asyncio.AbstractEventLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return thread


def stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, server: asyncio.Server) -> None:
    async def end() -> None:
        server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the transports' connection_lost, which close() scheduled
        await server.wait_closed()

    asyncio.run_coroutine_threadsafe(end(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()
