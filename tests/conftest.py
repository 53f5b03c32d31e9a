from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from proxy.app import create_app
from proxy.core.exchange import Exchange
from proxy.core.hooks import HOOKS, Observer
from proxy.server.uvicorn_server import Server
from proxy.settings import Settings, UpstreamSettings
from proxy.tools.fake_upstream import FakeUpstream

# The smallest chat request most tests send.
TEST_HEADERS = ["x-fake-*", "x-sim-*", "x-test-*"]
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run `app` under a real uvicorn on 127.0.0.1 with an OS-chosen port; yield its base URL."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="on",
        loop="asyncio",
        http="proxy.server.edge:EdgeProtocol",  # as `infertap serve` runs it, with the edge's limits
        access_log=False,
        proxy_headers=False,  # as `infertap serve` runs it: the client address is the peer's
        timeout_graceful_shutdown=2,
    )
    with server_in_thread(config) as (_, _, base):
        yield base


@contextmanager
def server_in_thread(config: uvicorn.Config) -> Iterator[tuple[Server, threading.Thread, str]]:
    """`config` served by infertap's Server (proxy/server/uvicorn_server.py), as `infertap serve`
    runs it, in a thread: the server, its thread and its base URL."""
    server = Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="server start")
    assert server.started, "server failed to start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield server, thread, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `cond` until true; fail after `timeout` seconds (a deadline, not a sleep that passes)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class RecordingObserver(Observer):
    """Records every hook with the request id, to check order and exactly-once rules."""

    name = "recording"
    TERMINAL = ("finished", "failed", "client_disconnected")

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.exchanges: dict[str, Exchange] = {}
        self.lock = threading.Lock()

    def _rec(self, hook: str, ex: Exchange) -> None:
        with self.lock:
            self.events.append((hook, ex.request_id))
            self.exchanges[ex.request_id] = ex

    def hooks_for(self, rid: str) -> list[str]:
        with self.lock:
            return [h for h, r in self.events if r == rid]

    def terminal_count(self, rid: str) -> int:
        return sum(h in self.TERMINAL for h in self.hooks_for(rid))

    def wait_terminal(self, rid: str, timeout: float = 10.0) -> Exchange:
        """Waits for the request's `ended`, which follows its terminal hook."""
        wait_until(lambda: "ended" in self.hooks_for(rid), timeout, f"terminal hook of {rid}")
        return self.exchanges[rid]


def _make_hook(hook: str) -> Callable[..., None]:
    def method(self: RecordingObserver, ex: Exchange, *args: Any) -> None:
        self._rec(hook, ex)

    return method


for _hook in HOOKS:
    if _hook not in ("answered", "replica_health"):  # not a forwarded request's: no Exchange
        setattr(RecordingObserver, _hook, _make_hook(_hook))


@pytest.fixture
def fake() -> Iterator[tuple[FakeUpstream, str]]:
    upstream = FakeUpstream()
    with serve_in_thread(upstream) as url:
        yield upstream, url + "/v1"


def make_settings(*upstreams: tuple[str, str], **extra: Any) -> Settings:
    # The fake upstream and the simulated engine are scripted by request headers the default
    # policy drops (x-fake-*, x-sim-*); tests script their own upstreams with x-test-*.
    ups = [UpstreamSettings(name=n, base_url=u, forward_headers=TEST_HEADERS) for n, u in upstreams]
    return Settings(upstreams=ups, **extra)


@contextmanager
def run_proxy(settings: Settings, *observers: Observer) -> Iterator[str]:
    with serve_in_thread(create_app(settings, observers)) as url:
        yield url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serve_process(
    *args: str, env: dict[str, str] | None = None, log: Path | None = None, timeout: float = 60
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`python -m proxy serve ARGS` as a user runs it, on a free loopback port; yields its base URL
    once /healthz answers. Output goes to `log` (a file, never a pipe that could fill up)."""
    port = free_port()
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    cmd = [sys.executable, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout, "infertap serve to answer /healthz")
        assert proc.poll() is None, f"infertap serve exited with {proc.returncode}" + (
            f": {log.read_text()}" if log is not None else ""
        )
        yield base, proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        if log is not None:
            out.close()  # type: ignore[union-attr]


def tool(name: str) -> str:
    """A command-line tool's path; skip when it is missing, but fail under CI=true, where
    scripts/install_deploy_tools.sh must have installed it."""
    path = shutil.which(name) or next(
        (str(p) for p in [Path(sys.executable).parent / name] if p.exists()), None
    )
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(f"{name} is missing in CI: scripts/install_deploy_tools.sh should have installed it")
    pytest.skip(f"{name} is not installed (run scripts/install_deploy_tools.sh)")
