"""Live stacks in tests (test_deploy_live.py, test_alert_drill.py, test_alertmanager.py): real processes on
127.0.0.1, waiting on conditions, a webhook receiver, a steady load, and the backfill of baseline
history from a measured rate."""

from __future__ import annotations

import json
import re
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import tool
from tests.promtext import samples

ROOT = Path(__file__).resolve().parent.parent


def wait_for(what: str, check: Callable[[], Any], deadline_s: float = 60.0, every: float = 0.2) -> Any:
    """Poll `check` until it returns something true (and return that); fail after the deadline."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, OSError, KeyError, IndexError) as e:
            last = e
        time.sleep(every)  # polling interval, bounded by the deadline
    raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what} (last: {last!r})")


def alertmanager_binary() -> str:
    """Debian's package installs it as prometheus-alertmanager, the upstream tarball as alertmanager."""
    return shutil.which("prometheus-alertmanager") or tool("alertmanager")


def start_sim(log: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """`infertap sim` on a free port; returns the process and its base URL (without /v1)."""
    with log.open("w") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "sim", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=ROOT,
        )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready, "the simulated engine did not start in 30 s"
    line = proc.stdout.readline()
    assert line.startswith("infertap-sim listening on "), line
    return proc, line.split(" on ", 1)[1].strip().removesuffix("/v1")


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


class Receiver:
    """Alertmanager's webhook receiver: every notification, with the path (receiver) it came to."""

    def __init__(self) -> None:
        self.notes: list[tuple[float, str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.notes.append((time.time(), self.path.strip("/"), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, path: str | None = None, since: float = 0.0) -> list[dict[str, Any]]:
        """Every alert of every notification (to `path`, received after `since`), flattened."""
        with self.lock:
            notes = list(self.notes)
        out = []
        for at, p, body in notes:
            if (path is None or p == path) and at >= since:
                out += [{**a, "receiver": p} for a in body["alerts"]]
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Load:
    """A steady workload through infertap: `rate` streamed chat requests a second whose prompts are
    `words` words long (changeable while it runs), and `bad_rate` requests a second without a model."""

    def __init__(self, proxy: str, model: str, rate: float, words: int) -> None:
        self.proxy, self.model, self.rate, self.words = proxy, model, rate, words
        self.bad_rate = 0.0
        self.sent = self.failed = self.bad = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=24)
        self._client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=32))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _one(self, words: int) -> None:
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "word " * words}],
        }
        try:
            with self._client.stream("POST", f"{self.proxy}/v1/chat/completions", json=body) as r:
                r.read()
                if r.status_code != 200:
                    self.failed += 1
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
        except httpx.HTTPError as e:
            self.failed += 1
            self.errors.append(repr(e))

    def _bad_one(self) -> None:
        r = self._client.post(f"{self.proxy}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400, r.text
        self.bad += 1

    def _run(self) -> None:
        start = time.monotonic()
        n = bad = 0
        while not self._stop.is_set():
            now = time.monotonic() - start
            if n <= now * self.rate:  # pacing: an open-loop arrival schedule, not an assertion
                self._pool.submit(self._one, self.words)
                n += 1
                self.sent += 1
            if self.bad_rate and bad <= now * self.bad_rate:
                self._pool.submit(self._bad_one)
                bad += 1
            self._stop.wait(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()


def counter_rates(
    first: str, second: str, seconds: float, keep: Callable[[str], bool]
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Per series: how fast each counter grew between two scrapes (gauges: their last value)."""
    before = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples(first)}
    out = {}
    for n, lab, v in samples(second):
        if not keep(n) or n.endswith("_created"):
            continue
        key = (n, tuple(sorted(lab.items())))
        counter = n.endswith(("_total", "_bucket", "_count", "_sum"))
        out[key] = (v - before.get(key, 0.0)) / seconds if counter else v
    return out


def backfill_openmetrics(
    rates: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    extra: dict[str, str],
    spans: list[tuple[float, float]],
    step: float,
) -> str:
    """OpenMetrics text for `promtool tsdb create-blocks-from openmetrics`: every series growing at its
    measured rate over each (start, end) span of Unix seconds, one sample every `step` seconds."""
    lines = []
    t0 = spans[0][0]
    for (name, labels), rate in sorted(rates.items()):
        lab = ",".join(f'{k}="{v}"' for k, v in (*labels, *extra.items()))
        counter = name.endswith(("_total", "_bucket", "_count", "_sum"))
        for start, end in spans:
            t = start
            while t <= end:
                value = rate * (t - t0) if counter else rate
                lines.append(f"{name}{{{lab}}} {value:.6f} {t:.3f}")
                t += step
    return "\n".join(lines) + "\n# EOF\n"


def used_metric_names(rules_text: str) -> set[str]:
    return set(re.findall(r"\binfertap_[a-z0-9_]+", rules_text))
