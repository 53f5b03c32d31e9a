"""proxy/server/ticks.py: uvicorn's server with a main loop that wakes once a second, not ten
times, and at once when told to exit; the Date header still turns with the second."""

from __future__ import annotations

import email.utils
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from proxy.server import ticks
from proxy.server.ticks import Server
from tests.conftest import wait_until


async def _app(scope: dict[str, object], receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 204, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]


@contextmanager
def served() -> Iterator[tuple[Server, threading.Thread, str]]:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="server start")
    assert server.started
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield server, thread, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_exit_does_not_wait_for_the_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ticks a day long: only the wake-up that setting should_exit sends can end the server within
    the join's 30 s (uvicorn's signal handler and the drain set it the same way)."""
    monkeypatch.setattr(ticks, "TICK_S", 86400.0)
    with served() as (server, thread, base):
        assert httpx.get(base).status_code == 204
        wait_until(lambda: server._woken is not None, what="the main loop asleep")
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_the_date_header_turns_with_the_second() -> None:
    with served() as (_, _, base):
        first = httpx.get(base).headers["date"]
        wait_until(
            lambda: httpx.get(base).headers["date"] != first, timeout=10, what="the next second's Date"
        )
        later = email.utils.parsedate_to_datetime(httpx.get(base).headers["date"])
    assert later > email.utils.parsedate_to_datetime(first)


def test_the_uvicorn_internals_the_server_builds_on() -> None:
    """uvicorn's main loop ticks on_tick(counter) and renews Date when counter % 10 == 0; its
    handle_exit and the drain set should_exit. This fails loudly if those change shape."""
    assert uvicorn.__version__.startswith("0.55.")
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    assert "counter % 10 == 0" in inspect.getsource(uvicorn.Server.on_tick)
    assert "self.should_exit = True" in inspect.getsource(uvicorn.Server.handle_exit)
    assert "should_exit" in inspect.getsource(uvicorn.Server.main_loop)
    from uvicorn.supervisors import multiprocess

    assert "Process(self.config, self.sockets)" in inspect.getsource(multiprocess.Multiprocess)
    assert "Server(config=self.config)" in inspect.getsource(multiprocess.Process)
