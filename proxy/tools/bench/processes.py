"""The processes of `infertap bench` (upstream, load generator, infertap) and what /proc says of them."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

from proxy.tools.bench.loadgen import Job, JobResult
from proxy.tools.bench.upstream import READY

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class BenchError(Exception):
    """A set-up failure, worded for the person running the bench."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (uvicorn's worker processes), from the ppid field of /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def cpu_seconds(pids: list[int], main_thread: bool = False) -> float:
    """CPU time of live processes, summed: all their threads (the ones that ended included), or
    with `main_thread` each one's first thread only, where its event loop runs (without the OTLP
    exporter's). Counted in nanoseconds by the scheduler where Linux gives it (the process's CPU
    clock; the main thread's schedstat(5), exact while it sleeps, as between the bench's rounds),
    else utime + stime from /proc/PID/stat, in 10 ms ticks: over a round of a few hundred ms of CPU
    that is 2-3%, coarser than the 2% the overhead-metrics target compares, and 15 paced streams
    at c=1 come to about 10 ticks."""
    total = 0.0
    for pid in pids:
        try:
            total += _main_thread_s(pid) if main_thread else time.clock_gettime(_process_clock(pid))
        except OSError:
            try:
                total += _ticks_s(pid, main_thread)
            except OSError:
                continue  # gone meanwhile
    return total


def _process_clock(pid: int) -> int:
    """What clock_getcpuclockid(3) returns on Linux: the process's CPU-time clock, its threads'
    time in ns, those that ended included (CPUCLOCK_SCHED, MAKE_PROCESS_CPUCLOCK)."""
    return ((~pid) << 3) | 2


def _main_thread_s(pid: int) -> float:
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


def _ticks_s(pid: int, main_thread: bool) -> float:
    stat = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
    fields = Path(stat).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15 of stat(5)


def status_mb(pids: list[int], key: str) -> float:
    """A /proc/PID/status memory field (VmRSS, VmHWM), summed over `pids`, in MB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total / 1024


def reset_peak_rss(pids: list[int]) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, `echo 5 > clear_refs`), so a peak is per scenario."""
    try:
        for pid in pids:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def affinity(pid: int) -> set[int] | None:
    try:
        return set(os.sched_getaffinity(pid))
    except (OSError, AttributeError):
        return None


def open_files_limit(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
    except (OSError, ValueError):
        pass
    return None


def http_get_json(port: int, path: str, timeout: float = 2.0) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"GET {path}: HTTP {resp.status}")
        return json.loads(body) if body else None
    finally:
        conn.close()


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the bench dies, even by SIGKILL (Linux prctl),
    so that a killed bench (a CI timeout) leaves no upstream or infertap behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _popen(cmd: list[str], nofile: int | None = None, **kw: Any) -> subprocess.Popen[Any]:
    """Start a child that dies with the bench; `nofile`: its soft open-file limit."""

    def setup() -> None:
        _die_with_parent()
        if nofile is not None:
            try:
                resource.setrlimit(
                    resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
                )
            except (ValueError, OSError):
                pass

    return subprocess.Popen(cmd, preexec_fn=setup, **kw)


def pin_child(pid: int, cpu: int | None) -> bool:
    """Pins a just-started child to `cpu` (its threads and children inherit it); False if not."""
    if cpu is None:
        return False
    try:
        os.sched_setaffinity(pid, {cpu})
    except OSError:
        return False
    return True


def wait_ready(
    proc: subprocess.Popen[Any], answers: Callable[[], bool], timeout_s: float, failure: Callable[[], str]
) -> None:
    """Polls `answers` until it is true; a BenchError with `failure()` when `proc` exits first or
    `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise BenchError(failure())
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Upstream:
    """The bench upstream (proxy/tools/bench/upstream.py) in its own process."""

    def __init__(self, cpu: int | None) -> None:
        cmd = [sys.executable, "-m", "proxy.tools.bench.upstream", "--host", "127.0.0.1", "--port", "0"]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        self.proc = _popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith(READY):
            _stop(self.proc)
            raise BenchError(
                f"the bench upstream did not start (exit {self.proc.poll()}, said {line!r}); "
                "run `python -m proxy.tools.bench.upstream` to see why"
            )
        self.url = line[len(READY) :].strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    def stats(self) -> dict[str, int]:
        data: dict[str, int] = http_get_json(self.port, "/bench/stats")
        return data

    def close(self) -> None:
        _stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class LoadGenerator:
    """proxy/tools/bench/loadgen.py in its own process, fed Jobs over a socket pair."""

    def __init__(self, cpu: int | None) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "proxy.tools.bench.loadgen", "--fd", str(theirs.fileno())]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        self.proc = _popen(cmd, pass_fds=[theirs.fileno()])
        theirs.close()
        self.conn = Connection(ours.detach())
        self.busy = False

    def start(self, job: Job) -> None:
        self.conn.send(job)
        self.busy = True

    def ready(self, wait_s: float) -> bool:
        """Whether the result is there (waiting up to `wait_s` for it)."""
        if self.proc.poll() is not None:
            return True  # result() says what happened
        return self.conn.poll(wait_s)

    def result(self, timeout_s: float) -> JobResult:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None:
                raise BenchError(
                    f"the load generator exited (code {self.proc.returncode}); see its stderr above"
                )
            if time.monotonic() > deadline:
                raise BenchError(f"the load generator gave no result within {timeout_s:.0f} s")
        try:
            result: JobResult = self.conn.recv()
        except EOFError:  # it died between poll() and recv(): its traceback is on stderr above
            raise BenchError("the load generator exited mid-job; see its stderr above") from None
        self.busy = False
        return result

    def run(self, job: Job, timeout_s: float) -> JobResult:
        self.start(job)
        return self.result(timeout_s)

    def close(self) -> None:
        if self.busy:  # interrupted mid-job: nothing to wait for
            _stop(self.proc)
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.conn.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _stop(self.proc)


class ServerProcess:
    """A server the bench started (its stderr kept in a temporary file): its process tree for the CPU
    counts, the end of its stderr for an error message, and its stop."""

    proc: subprocess.Popen[Any]
    log: IO[bytes]
    pids: list[int]
    TAIL = 2000  # characters of stderr an error message quotes

    def refresh_pids(self) -> list[int]:
        self.pids = process_tree(self.proc.pid)
        return self.pids

    def stderr_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-self.TAIL :]

    def close(self) -> None:
        _stop(self.proc)
        self.log.close()


class Infertap(ServerProcess):
    """`infertap serve` in front of the bench upstream, as a user would run it (plus the bench's env)."""

    def __init__(
        self,
        label: str,
        upstream_url: str,
        cpu: int | None,
        workers: int = 1,
        tracing_to: str = "",
        flush_ms: int = 0,
        nofile: int | None = None,
        extra_env: dict[str, str] | None = None,
        config: str | None = None,
    ):
        """`config`: a config.toml that names the upstreams (the fleet's pool) instead of `upstream_url`."""
        self.label = label
        self.port = free_port()
        cmd = [sys.executable, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if config is None:
            cmd += ["--upstream", f"bench={upstream_url}/v1", "--forward-header", "x-bench-*"]
        else:
            cmd += ["--config", config]
        if workers > 1:
            cmd += ["--workers", str(workers)]
        # Hermetic: the caller's INFERTAP_* or OTEL_* settings (a config file, client keys, an OTLP
        # endpoint) would change what is measured.
        # Otherwise as users run it: the defaults, the access log (one line per request) included.
        # INFERTAP_NATIVE stays: which hot path runs is the bench's to choose (proxy/compiled/).
        env = {
            k: v
            for k, v in os.environ.items()
            if k == "INFERTAP_NATIVE" or not k.startswith(("INFERTAP_", "OTEL_"))
        }
        env.update(extra_env or {})
        if tracing_to:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = tracing_to
            if flush_ms:
                env["OTEL_BSP_SCHEDULE_DELAY"] = str(flush_ms)
        self.log = tempfile.TemporaryFile()
        # `nofile`: the soft limit the bench itself started with, so that what infertap does with
        # it (raise it to the hard limit, or not) shows in /proc/PID/limits.
        self.proc = _popen(cmd, nofile, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        # Right after exec, before the interpreter starts any thread: all of them inherit it.
        self.pinned = pin_child(self.proc.pid, cpu)
        self.pids = [self.proc.pid]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        def answers() -> bool:
            try:
                http_get_json(self.port, "/healthz", timeout=1.0)
            except (OSError, ValueError, http.client.HTTPException):
                return False
            return True

        wait_ready(
            self.proc,
            answers,
            timeout_s,
            lambda: (
                f"infertap ({self.label}) did not answer /healthz within {timeout_s:.0f} s "
                f"(exit code {self.proc.poll()}). Its stderr ends with:\n{self.stderr_tail()}\n"
                "Run `infertap serve --upstream http://127.0.0.1:9/v1` by hand to see whether it starts."
            ),
        )
        self.refresh_pids()
