"""proxy/server/uvicorn_server.py: uvicorn's server with a main loop that sleeps until it is told to
exit, woken at once then; the Date header still turns with the second."""

from __future__ import annotations

import email.utils
import inspect
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from proxy.server.uvicorn_server import Server
from tests.conftest import server_in_thread, wait_until


async def _app(scope: dict[str, object], receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 204, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]


@contextmanager
def served() -> Iterator[tuple[Server, threading.Thread, str]]:
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
        http="proxy.server.edge:EdgeProtocol",
        headers=[("x-served-by", "test")],
    )
    with server_in_thread(config) as served:
        yield served


def test_exit_is_woken_at_once() -> None:
    """The main loop sleeps with no timer: only the wake-up that setting should_exit sends can end
    the server within the join's 30 s (uvicorn's signal handler and the drain set it the same way)."""
    with served() as (server, thread, base):
        assert httpx.get(base).status_code == 204
        wait_until(lambda: server._woken is not None, what="the main loop asleep")
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_the_date_header_turns_with_the_second() -> None:
    """No tick renews it: the first request of a new second does (renew_date, from the edge)."""
    with served() as (_, _, base):
        first = httpx.get(base).headers["date"]
        wait_until(
            lambda: httpx.get(base).headers["date"] != first, timeout=10, what="the next second's Date"
        )
        answer = httpx.get(base)
        later = email.utils.parsedate_to_datetime(answer.headers["date"])
        assert answer.headers["x-served-by"] == "test"  # the default headers beside Date stay
        # A malformed request's 400 (before any head is complete) has this second's Date too.
        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as sock:
            wait_until(lambda: int(time.time()) > int(later.timestamp()), what="the next second")
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
            refused = sock.recv(65536).decode("latin-1")
        assert refused.startswith("HTTP/1.1 400")
        date = next(
            line.split(": ", 1)[1] for line in refused.split("\r\n") if line.lower().startswith("date:")
        )
        assert email.utils.parsedate_to_datetime(date) > later
    assert later > email.utils.parsedate_to_datetime(first)


def test_the_uvicorn_internals_the_server_builds_on() -> None:
    """uvicorn's main loop ticks on_tick(counter) and renews Date when counter % 10 == 0; its
    handle_exit and the drain set should_exit. This fails loudly if those change shape."""
    assert uvicorn.__version__.startswith("0.55.")
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    assert "counter % 10 == 0" in inspect.getsource(uvicorn.Server.on_tick)
    assert "self.server_state.default_headers = date_header + self.config.encoded_headers" in (
        inspect.getsource(uvicorn.Server.on_tick)
    )
    assert "self.should_exit = True" in inspect.getsource(uvicorn.Server.handle_exit)
    assert "should_exit" in inspect.getsource(uvicorn.Server.main_loop)
    from uvicorn.supervisors import multiprocess

    assert "Process(self.config, self.sockets)" in inspect.getsource(multiprocess.Multiprocess)
    assert "Server(config=self.config)" in inspect.getsource(multiprocess.Process)
