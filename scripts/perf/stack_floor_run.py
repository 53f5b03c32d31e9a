"""Runs scripts/perf/stack_floor.py's minimal relays beside infertap, nginx and vllm-router, in
interleaved rounds.

  python scripts/perf/stack_floor_run.py [--rounds N] [--relays MODE,...] [LOAD ...]

LOAD: paced1 (one 100-token stream at a time, TTFT 50 ms, tokens 10 ms apart), paced64 (64 such
streams at once), zero (zero-delay 100-token streams, 64 at once), nonstream (zero-delay
non-streaming requests, 64 at once); all four by default. The bench's upstream and load generator
share core 0, each relay runs alone on core 1, as in `infertap bench`. Prints, per load and relay,
the median over the rounds of the relay's CPU per request (user and system time apart), the added
TTFT p50 against the direct row, and requests per second. nginx and vllm-router run where the bench
finds them (scripts/install_bench_tools.sh); --relays picks the minimal relays (default: all).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.tools.bench.loadgen import Job  # noqa: E402
from proxy.tools.bench.nginx import Nginx, find_nginx  # noqa: E402
from proxy.tools.bench.processes import Infertap, LoadGenerator, Upstream, pin_child, wait_ready  # noqa: E402
from proxy.tools.bench.vllm_router import VllmRouter, find_vllm_router  # noqa: E402

MODES = ("raw-raw", "raw-aiohttp", "uvicorn-raw", "uvicorn-aiohttp", "uvicorn-proto")
LOADS = {
    "paced1": Job("127.0.0.1", 0, True, 1, 15, ttft_ms=50, itl_ms=10),
    "paced64": Job("127.0.0.1", 0, True, 64, 640, ttft_ms=50, itl_ms=10),
    "zero": Job("127.0.0.1", 0, True, 64, 3000),
    "nonstream": Job("127.0.0.1", 0, False, 64, 6000),
}


def user_sys(pids: list[int]) -> tuple[float, float]:
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        user += int(fields[11])
        system += int(fields[12])
    return user / tick, system / tick


class Relay:
    def __init__(self, mode: str, upstream_port: int) -> None:
        self.label = mode
        port_file = Path(tempfile.mkdtemp()) / "port"
        cmd = [
            sys.executable,
            str(ROOT / "scripts/perf/stack_floor.py"),
            mode,
            str(upstream_port),
            str(port_file),
        ]
        self.proc = subprocess.Popen(cmd)
        pin_child(self.proc.pid, 1)
        self.pids = [self.proc.pid]
        self.port = 0

        def answers() -> bool:
            text = port_file.read_text() if port_file.exists() else ""
            if not text:
                return False
            self.port = int(text)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                return False
            return True

        wait_ready(self.proc, answers, 20, lambda: f"the {mode} relay did not start (see its stderr above)")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("loads", nargs="*", metavar="LOAD", help=f"one of {', '.join(LOADS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--relays", default=",".join(MODES), help="minimal relays to run, comma-separated")
    args = ap.parse_args()
    relays = [m for m in args.relays.split(",") if m]
    for mode in relays:
        if mode not in MODES:
            ap.error(f"unknown relay {mode!r}: choose from {', '.join(MODES)}")
    for load in args.loads:
        if load not in LOADS:
            ap.error(f"unknown load {load!r}: choose from {', '.join(LOADS)}")
    args.loads = args.loads or list(LOADS)
    up = Upstream(0)
    lg = LoadGenerator(0)
    targets: dict[str, object] = {"direct": None}
    exe = find_nginx()
    if exe:
        nginx = Nginx("nginx", exe, up.port, 1, None)
        nginx.wait_ready()
        targets["nginx"] = nginx
    else:
        print("nginx not found: its row is left out (scripts/install_bench_tools.sh)", file=sys.stderr)
    router_exe = find_vllm_router()
    if router_exe:
        router = VllmRouter("vllm-router", router_exe, [up.url], "round_robin", 1)
        router.wait_ready()
        targets["vllm-router"] = router
    else:
        print("vllm-router not found: its row is left out (scripts/install_bench_tools.sh)", file=sys.stderr)
    for mode in relays:
        targets[mode] = Relay(mode, up.port)
    infertap = Infertap("infertap", up.url, 1)
    infertap.wait_ready()
    targets["infertap"] = infertap
    names = list(targets)
    try:
        for load in args.loads:
            rows: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in names}
            for name in names:  # warm-up
                t = targets[name]
                lg.run(Job("127.0.0.1", t.port if t else up.port, True, 4, 50), 60)  # type: ignore[attr-defined]
            for r in range(args.rounds):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    t = targets[name]
                    port = t.port if t else up.port  # type: ignore[attr-defined]
                    pids = t.pids if t else []  # type: ignore[attr-defined]
                    u0, s0 = user_sys(pids)
                    res = lg.run(dataclasses.replace(LOADS[load], port=port), 600)
                    u1, s1 = user_sys(pids)
                    ttft = statistics.median(res.ttft) * 1e3 if res.ttft else 0.0
                    rows[name].append(
                        ((u1 - u0) / res.ok * 1e3, (s1 - s0) / res.ok * 1e3, ttft, res.ok / res.wall_s)
                    )
                    print(f"  {load} round {r + 1}: {name} done ({res.ok}/{res.requests})", file=sys.stderr)
            direct_ttft = statistics.median(x[2] for x in rows["direct"])
            print(f"\n{load}: median of {args.rounds} rounds")
            print(f"{'relay':16s} {'user ms/req':>11s} {'sys ms/req':>10s} {'CPU ms/req':>10s}", end="")
            print(f" {'+TTFT p50':>9s} {'req/s':>7s}")
            for name in names:
                user = statistics.median(x[0] for x in rows[name])
                system = statistics.median(x[1] for x in rows[name])
                total = statistics.median(x[0] + x[1] for x in rows[name])
                ttft = statistics.median(x[2] for x in rows[name]) - direct_ttft
                rps = statistics.median(x[3] for x in rows[name])
                added = f"{ttft:+9.2f}" if rows[name][0][2] else f"{'-':>9s}"
                print(f"{name:16s} {user:11.3f} {system:10.3f} {total:10.3f} {added} {rps:7.0f}")
    finally:
        for t in targets.values():
            if t is not None:
                t.close()  # type: ignore[attr-defined]
        lg.close()
        up.close()


if __name__ == "__main__":
    main()
