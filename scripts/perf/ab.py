"""Two (or more) infertap source trees side by side, in interleaved rounds: CPU per request.

  .venv/bin/python scripts/perf/ab.py ROUNDS LOAD[,LOAD...] LABEL=TREE [LABEL=TREE ...]
  e.g. git worktree add /tmp/before HEAD~1
       .venv/bin/python scripts/perf/ab.py 4 nonstream,zero before=/tmp/before after=.

Each tree runs as `python -m proxy serve` with that tree first on sys.path, in front of the bench's
upstream, pinned to core 1 (the upstream and the load generator on core 0), as `infertap bench`
runs it. Every round runs every tree once, the order rotating; a tree's number is the median over
the rounds of its CPU (utime + stime) per request, with the range. AB_ENV="K=V ..." adds
environment variables to every tree, `LABEL=TREE,K=V,...` to one (e.g.
`off=.,INFERTAP_METRICS__ACCESS_LOG=false`). Each tree's stderr goes to a temporary file, as in
`infertap bench` (its access log costs what it costs there).

LOAD: paced1 (one 100-token stream at a time, TTFT 50 ms, tokens 10 ms apart), paced64 (64 such
at once), zero (zero-delay 100-token streams, 64 at once), zero1 (one at a time), nonstream
(zero-delay non-streaming requests, 64 at once).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.tools.bench import processes as P  # noqa: E402
from proxy.tools.bench.loadgen import Job  # noqa: E402

LOADS = {
    "paced1": Job("127.0.0.1", 0, True, 1, 15, ttft_ms=50, itl_ms=10),
    "paced64": Job("127.0.0.1", 0, True, 64, 640, ttft_ms=50, itl_ms=10),
    "zero": Job("127.0.0.1", 0, True, 64, 3000),
    "zero1": Job("127.0.0.1", 0, True, 1, 300),
    "nonstream": Job("127.0.0.1", 0, False, 64, 6000),
}


def wait_ready(label: str, p: subprocess.Popen[bytes], port: int) -> None:
    """Until the tree's infertap on `port` answers /healthz (exits when it died or took a minute)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            P.http_get_json(port, "/healthz")
            return
        except (OSError, ValueError):
            if time.monotonic() > deadline or p.poll() is not None:
                sys.exit(f"{label} did not start")
            time.sleep(0.2)


def main() -> None:
    if len(sys.argv) < 4 or any(load not in LOADS for load in sys.argv[2].split(",")):
        sys.exit(__doc__)
    rounds, loads = int(sys.argv[1]), sys.argv[2].split(",")
    trees = [arg.split("=", 1) for arg in sys.argv[3:]]
    up, lg = P.Upstream(0), P.LoadGenerator(0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "OTEL_"))}
    for kv in os.environ.get("AB_ENV", "").split():
        name, _, value = kv.partition("=")
        env[name] = value
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for label, spec in trees:
            tree, *settings = spec.split(",")
            extra = dict(kv.split("=", 1) for kv in settings)
            port = P.free_port()
            cmd = [sys.executable, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--upstream", f"bench={up.url}/v1", "--forward-header", "x-bench-*"]
            tree = str(Path(tree).resolve())
            log = tempfile.TemporaryFile()  # noqa: SIM115 (open until the process ends)
            p = subprocess.Popen(cmd, env=dict(env, **extra, PYTHONPATH=tree), cwd=tree, stderr=log)
            P.pin_child(p.pid, 1)
            procs[label] = (p, port)
        for _label, (p, port) in procs.items():
            wait_ready(_label, p, port)
            for stream in (True, False):  # warm-up: connections, caches
                lg.run(Job("127.0.0.1", port, stream, 8, 400), 60)
        names = list(procs)
        for load in loads:
            cpu: dict[str, list[float]] = {n: [] for n in names}
            for r in range(rounds):
                k = r % len(names)
                for n in names[k:] + names[:k]:
                    p, port = procs[n]
                    job = dataclasses.replace(LOADS[load], port=port)
                    c0 = P.cpu_seconds([p.pid])
                    out = lg.run(job, 600)
                    c1 = P.cpu_seconds([p.pid])
                    if out.ok != job.count:
                        sys.exit(f"{n}: {out.ok} of {job.count} ok ({dict(out.errors)})")
                    cpu[n].append((c1 - c0) * 1000 / job.count)
            for n in names:
                v = cpu[n]
                print(
                    f"{load:10s} {n:12s} CPU ms/req {statistics.median(v):.4f} ({min(v):.4f}..{max(v):.4f})"
                )
    finally:
        for p, _ in procs.values():
            p.kill()
        lg.close()
        up.close()


if __name__ == "__main__":
    main()
