"""infertap's instructions per request, counted by valgrind's callgrind: a number that does not
move with the machine's load, for changes too small for the rounds of CPU time to separate.

  .venv/bin/python scripts/perf/instructions.py LOAD N LABEL=TREE [LABEL=TREE ...]
  e.g. .venv/bin/python scripts/perf/instructions.py nonstream 1000 before=/tmp/before after=.

Each tree runs under `valgrind --tool=callgrind` (about 50x slower), in front of the bench's
upstream; after a warm-up the counters are zeroed, N requests run, and the user-space instructions
they took (the kernel's are not counted) are divided by N. The counts include what the process
did meanwhile besides the requests (its timers), so compare runs of the same LOAD and N.
A TREE of `floor:MODE` counts one of scripts/perf/stack_floor.py's minimal relays instead
(`floor:uvicorn-proto`: the layers infertap is built on, without its own work), so that
infertap's own instructions per request are the difference. `LABEL=TREE,NAME=VALUE,...` runs
TREE with those environment variables (`off=.,INFERTAP_METRICS__OVERHEAD=false`).
Needs Debian's valgrind. LOAD: nonstream (8 at once), zero (zero-delay 100-token streams, 8 at
once), paced (100-token streams 10 ms apart, 2 at once: an event per upstream read).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.tools.bench import processes as P  # noqa: E402
from proxy.tools.bench.loadgen import Job  # noqa: E402

LOADS = {
    "nonstream": Job("127.0.0.1", 0, False, 8, 0, timeout_s=300),
    "zero": Job("127.0.0.1", 0, True, 8, 0, timeout_s=300),
    "paced": Job("127.0.0.1", 0, True, 2, 0, ttft_ms=20, itl_ms=10, timeout_s=300),
}


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] not in LOADS:
        sys.exit(__doc__)
    load, n = LOADS[sys.argv[1]], int(sys.argv[2])
    warm = 20 if sys.argv[1] == "paced" else 300
    up, lg = P.Upstream(0), P.LoadGenerator(0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "OTEL_"))}
    try:
        for arg in sys.argv[3:]:
            label, tree = arg.split("=", 1)
            tree, *settings = tree.split(",")  # TREE,NAME=VALUE,...: infertap's environment
            extra = dict(kv.split("=", 1) for kv in settings)
            floor = tree.removeprefix("floor:") if tree.startswith("floor:") else None
            tree = str(ROOT if floor else Path(tree).resolve())
            port = P.free_port()
            port_file = Path(f"/tmp/infertap-callgrind.{label}.port")
            port_file.unlink(missing_ok=True)
            out = f"/tmp/infertap-callgrind.{label}.out"
            for f in glob.glob(out + "*"):
                os.remove(f)
            cmd = [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "proxy",
            ]
            if floor:
                up_port = up.url.rsplit(":", 1)[1]
                cmd[-2:] = [str(ROOT / "scripts/perf/stack_floor.py"), floor, up_port, str(port_file)]
            else:
                cmd += ["serve", "--host", "127.0.0.1", "--port", str(port)]
                cmd += ["--upstream", f"bench={up.url}/v1", "--forward-header", "x-bench-*"]
            env_tree = dict(env, **extra, PYTHONPATH=tree)
            p = subprocess.Popen(cmd, env=env_tree, cwd=tree, stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 300
                while True:
                    try:
                        if floor:  # its port once written, then a connection it accepts
                            port = int(port_file.read_text() or "x")
                            socket.create_connection(("127.0.0.1", port), timeout=5).close()
                        else:
                            P.http_get_json(port, "/healthz", timeout=5)
                        break
                    except (OSError, ValueError):
                        if time.monotonic() > deadline or p.poll() is not None:
                            sys.exit(f"{label} did not start under valgrind")
                        time.sleep(0.5)
                lg.run(dataclasses.replace(load, port=port, count=warm), 900)
                subprocess.run(["callgrind_control", "--zero", str(p.pid)], capture_output=True, check=True)
                r = lg.run(dataclasses.replace(load, port=port, count=n), 3600)
                if r.ok != n:
                    sys.exit(f"{label}: {r.ok} of {n} ok ({dict(r.errors)})")
                subprocess.run(["callgrind_control", "--dump", str(p.pid)], capture_output=True, check=True)
                time.sleep(1)
                dump = max(glob.glob(out + ".*"), key=os.path.getmtime)
                m = re.search(r"^summary:\s+(\d+)", Path(dump).read_text(), re.M)
                assert m is not None, dump
                print(f"{sys.argv[1]} {label}: {int(m.group(1)) / n / 1000:.1f}k instructions per request")
            finally:
                p.kill()
                p.wait()
    finally:
        lg.close()
        up.close()


if __name__ == "__main__":
    main()
