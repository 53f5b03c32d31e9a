"""Where a stream's added TTFT goes inside infertap: the wall time between checkpoints on the way of
a request to its upstream and of its first output event back to the client, one stream at a time
(the `infertap bench` target "added TTFT p50 within 0.3 ms of nginx's, one at a time").

  .venv/bin/python scripts/perf/ttft_path.py ROUNDS N LABEL=TREE[,NAME=VALUE...] [LABEL=TREE ...]
  e.g. .venv/bin/python scripts/perf/ttft_path.py 4 100 before=/tmp/before after=.

Each tree runs as `python -m proxy serve` in front of the bench's upstream, pinned to core 1 (the
upstream and the load generator on core 0), with probes patched onto a few of its methods; every
round sends N streams (TTFT 20 ms, 5 tokens 5 ms apart) one at a time to each tree, the order
rotating. For each checkpoint the median over all requests of the time since the one before, in
microseconds:

  A, the request's way to its upstream: in (the read that holds the request's head: the clock
  starts) · hc (llhttp has the head) · start (the cycle's task created) · mc (the body complete) ·
  run0 (the task runs) · task (the dispatch) · handle (the forwarder) · rcvd (intake done:
  request_received) · run (attempts) · att (an attempt) · started (attempt_started) · send (the
  upstream client) · upw (the request's write to the upstream)
  B, the first output's way back: read (the upstream's read that holds it: the clock starts) ·
  feed (the scanner) · health (the attempt judged) · commit · rstart (the answer's head) · relay ·
  out (the write to the client that carries it)

Between its streams the process sleeps ~20 ms, so this is the cold-cache path a request takes on an
idle core (each step is several times its warm cost); the probes themselves add ~1 us a checkpoint.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


Checkpoint = tuple[Any, str, str]  # what holds the function, its name, the step's label


def checkpoints() -> tuple[list[Checkpoint], list[Checkpoint]]:
    """The functions whose calls mark the steps of the way in and of the way back (the first, `in`
    and `read`, and the last, `out`, are marked where _probe patches them)."""
    from proxy.control import dispatch
    from proxy.core import hooks, sse
    from proxy.core.forward import attempts, forwarder
    from proxy.server import raw_cycle, request_head
    from proxy.transport import h1_client, h1_connection

    way_in = [
        (request_head.RequestHead, "on_headers_complete", "hc"),
        (request_head.RequestHead, "start", "start"),
        (request_head.RequestHead, "on_message_complete", "mc"),
        (raw_cycle.RawCycle, "run", "run0"),
        (dispatch.Dispatch, "__call__", "task"),
        (forwarder.Forwarder, "handle", "handle"),
        (hooks.ObserverSet, "request_received", "rcvd"),
        (forwarder.Forwarder, "run", "run"),
        (attempts.Attempter, "run", "att"),
        (hooks.ObserverSet, "attempt_started", "started"),
        (h1_client.H1Client, "send", "send"),
        (h1_connection.H1Connection, "write", "upw"),
    ]
    way_back = [
        (sse.SSEScanner, "feed", "feed"),
        (forwarder.Forwarder, "_health", "health"),
        (forwarder.Forwarder, "_commit", "commit"),
        (forwarder, "relay_committed", "relay"),
        (raw_cycle.RawCycle, "start", "rstart"),
    ]
    return way_in, way_back


def _probe(out: str) -> None:
    """Patches the checkpoints onto the tree on sys.path; a line per request goes to `out`."""
    from proxy.server import raw_cycle, request_head
    from proxy.transport import h1_connection

    way_in, way_back = checkpoints()
    clock = time.perf_counter
    sink = open(out, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    marks: list[tuple[str, float]] = []
    back: list[tuple[str, float]] = []
    first = [False]

    def patch(owner: Any, name: str, label: str, into: list[tuple[str, float]]) -> None:
        orig = getattr(owner, name)
        if inspect.iscoroutinefunction(orig):

            async def marked_async(*args: Any, **kwargs: Any) -> Any:
                if first[0]:
                    into.append((label, clock()))
                return await orig(*args, **kwargs)

            setattr(owner, name, marked_async)
        else:

            def marked(*args: Any, **kwargs: Any) -> Any:
                if first[0]:
                    into.append((label, clock()))
                return orig(*args, **kwargs)

            setattr(owner, name, marked)

    # A connection's reads go to its RequestHead's data_received (RawRoutesProtocol.__init__).
    received = request_head.RequestHead.data_received

    def data_received(self: Any, data: bytes) -> None:
        if data[:5] == b"POST ":
            first[0] = True
            marks[:] = [("in", clock())]
        received(self, data)

    request_head.RequestHead.data_received = data_received  # type: ignore[method-assign]
    for owner, name, label in way_in:
        patch(owner, name, label, marks)
    upstream_read = h1_connection.H1Connection.data_received

    def read(self: Any, data: bytes) -> None:
        back[:] = [("read", clock())]
        upstream_read(self, data)

    h1_connection.H1Connection.data_received = read  # type: ignore[method-assign]
    for owner, name, label in way_back:
        patch(owner, name, label, back)

    def out_marked(orig: Any) -> Any:
        def written(self: Any, *args: Any) -> Any:
            # The first write of the answer's bytes (a head held for the next turn counts as one).
            if first[0] and (orig.__name__ != "_flush" or self._head is not None):
                first[0] = False
                ends = [*back, ("out", clock())]
                line = [
                    f"{b[0]}:{(b[1] - a[1]) * 1e6:.1f}" for steps in (marks, ends) for a, b in _pairs(steps)
                ]
                sink.write(" ".join(line) + "\n")
            return orig(self, *args)

        return written

    for name in ("write", "push", "_flush"):
        setattr(raw_cycle.RawCycle, name, out_marked(getattr(raw_cycle.RawCycle, name)))


def _pairs(steps: list[tuple[str, float]]) -> zip[tuple[tuple[str, float], tuple[str, float]]]:
    return zip(steps, steps[1:], strict=False)


def _serve(out: str, argv: list[str]) -> None:
    _probe(out)
    sys.argv = ["proxy", *argv]
    runpy.run_module("proxy", run_name="__main__")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        _serve(sys.argv[2], sys.argv[3:])
        return
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    sys.path.insert(0, str(ROOT))
    from ab import wait_ready  # (this script's folder is on sys.path when it runs)

    from proxy.tools.bench import processes as P
    from proxy.tools.bench.loadgen import Job

    rounds, n = int(sys.argv[1]), int(sys.argv[2])
    way_in = {label for _, _, label in checkpoints()[0]}
    job = Job("127.0.0.1", 0, True, 1, n, ttft_ms=20, itl_ms=5, tokens=5)
    up, lg = P.Upstream(0), P.LoadGenerator(0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "OTEL_"))}
    procs: dict[str, tuple[subprocess.Popen[bytes], int, Path]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="infertap-ttft-path."))
    try:
        for arg in sys.argv[3:]:
            label, spec = arg.split("=", 1)
            tree, *settings = spec.split(",")
            extra = dict(kv.split("=", 1) for kv in settings)
            tree = str(Path(tree).resolve())
            port = P.free_port()
            out = workdir / f"{label}.txt"
            cmd = [sys.executable, __file__, "--serve", str(out), "serve", "--host", "127.0.0.1"]
            cmd += ["--port", str(port), "--upstream", f"bench={up.url}/v1", "--forward-header", "x-bench-*"]
            log = tempfile.TemporaryFile()  # noqa: SIM115 (open until the process ends)
            p = subprocess.Popen(cmd, env=dict(env, **extra, PYTHONPATH=tree), cwd=tree, stderr=log)
            P.pin_child(p.pid, 1)
            procs[label] = (p, port, out)
        for label, (p, port, out) in procs.items():
            wait_ready(label, p, port)
            lg.run(Job("127.0.0.1", port, True, 8, 200), 60)  # warm-up: connections, caches
            out.write_text("")
        names = list(procs)
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                lg.run(dataclasses.replace(job, port=procs[name][1]), 600)
            print(f"round {r + 1} of {rounds}", file=sys.stderr)
        for name in names:
            columns: dict[str, list[float]] = {}
            lines = procs[name][2].read_text().split("\n")
            for line in lines:
                for item in line.split():
                    key, value = item.split(":")
                    columns.setdefault(key, []).append(float(value))
            a = sum(statistics.median(v) for k, v in columns.items() if k in way_in)
            b = sum(statistics.median(v) for k, v in columns.items() if k not in way_in)
            steps = "  ".join(f"{k} {statistics.median(v):.1f}" for k, v in columns.items())
            print(f"{name} ({len(columns.get('upw', []))} streams): A {a:.0f} us, B {b:.0f} us\n  {steps}")
    finally:
        for p, _, _ in procs.values():
            p.kill()
        lg.close()
        up.close()


if __name__ == "__main__":
    main()
