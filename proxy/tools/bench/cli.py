"""`infertap bench`: infertap's overhead, measured against a direct connection in the same run.

It starts a fast local OpenAI-compatible upstream (proxy/tools/bench/upstream.py) and infertap in
front of it, then drives both with a cheap load generator (proxy/tools/bench/loadgen.py): the
upstream and the load generator share core 0, infertap has core 1 to itself, so what infertap
adds is not blurred by the harness fighting it for a core. When nginx is installed, the same load
goes through nginx (`proxy_buffering off`, on infertap's core) in the same run: the tables read
direct / nginx / infertap, and the targets are ratios to nginx. Every scenario runs in rounds
that rotate the order of the targets; a row is the median of its rounds, with the spread.

The scenarios are closed loops (N streams at a time, each starting when one ends) and, in
`poisson`, open loops: streams arriving at random at a fixed rate, however slow the target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import sys
import threading
import time
from typing import Any

from proxy import __version__, compiled
from proxy.server.os_limits import raise_nofile
from proxy.tools.bench.fleet import fleet_targets, run_fleet
from proxy.tools.bench.nginx import INSTALL_HINT, find_nginx
from proxy.tools.bench.processes import BenchError, affinity, open_files_limit
from proxy.tools.bench.report import NGINX, VLLM_ROUTER
from proxy.tools.bench.runner import Bench, log
from proxy.tools.bench.scenarios import POISSON_RATES, PROXY, Scenario, scenarios
from proxy.tools.bench.tables import render
from proxy.tools.bench.targets import targets
from proxy.tools.bench.vllm_router import INSTALL_HINT as VLLM_ROUTER_HINT
from proxy.tools.bench.vllm_router import find_vllm_router


def _machine(bench: Bench, nofile: tuple[int, int]) -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    proxy = bench.proxies.get(PROXY) or next(iter(bench.proxies.values()), None)
    if bench.harness_cpu is not None and bench.upstream and bench.loadgen:
        # Checked, not assumed: the harness processes pin themselves and say nothing when they cannot.
        for what, pid in (("upstream", bench.upstream.proc.pid), ("load generator", bench.loadgen.proc.pid)):
            if affinity(pid) != {bench.harness_cpu}:
                bench.notes.append(f"the bench {what} is not pinned to CPU {bench.harness_cpu}")
    return {
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "infertap": __version__,
        # The proxies run what this process imported: compiled, or why not (proxy/compiled/).
        "hot_path": compiled.state,
        "harness_cpu": bench.harness_cpu,
        "proxy_cpu": bench.proxy_cpu,
        "nofile_soft_before": nofile[0],
        "nofile_soft_now": nofile[1],
        "infertap_nofile": open_files_limit(proxy.proc.pid) if proxy else None,
        "notes": bench.notes,
    }


def build_parser() -> argparse.ArgumentParser:
    names = [s.name for s in scenarios(False)] + ["fleet"]
    listing = "\n".join(f"  {s.name:<11} {s.title}" for s in scenarios(False))
    listing += (
        "\n  fleet       N simulated engines behind each balancing policy (multi-turn chat, one slow "
        "replica):\n              run only when named (--scenario fleet)"
    )
    p = argparse.ArgumentParser(
        prog="infertap bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"scenarios:\n{listing}\n\nexamples:\n  infertap bench\n  infertap bench --quick\n"
        "  infertap bench --scenario throughput --json bench.json\n  infertap bench --markdown\n"
        "  infertap bench --scenario poisson --rate 60 --rounds 5\n\n"
        f"nginx: where it is installed, every scenario runs it too ({INSTALL_HINT}).\n"
        f"vllm-router: likewise, beside nginx ({VLLM_ROUTER_HINT}).\n"
        "Exit status: 0 when every request through infertap (and direct) succeeded, targets missed\n"
        "or not; 1 when some failed; 2 when the bench could not run. Failures in nginx's and\n"
        "vllm-router's rows are shown in their rows and on stderr, and do not change it.\n"
        "See docs/benchmarks.md.",
    )
    p.add_argument("--scenario", action="append", choices=names, help="run only this one (repeatable)")
    p.add_argument("--quick", action="store_true", help="smoke mode: tiny counts, one round (CI)")
    p.add_argument(
        "--rounds", type=int, metavar="N",
        help="rounds per scenario, target order rotating (default 3; 4 where two infertap rows are "
        "compared; --quick: 1, or 2 there)",
    )  # fmt: skip
    p.add_argument(
        "--rate", type=float, action="append", metavar="R",
        help="an open-loop (poisson) rate in streams/s (repeatable; default 30 and 60)",
    )  # fmt: skip
    p.add_argument(
        "--no-nginx", action="store_true", help="skip the nginx reference row even where nginx is installed"
    )
    p.add_argument(
        "--no-vllm-router", action="store_true",
        help="skip the vllm-router reference rows even where vllm-router is installed",
    )  # fmt: skip
    p.add_argument(
        "--replicas", type=int, default=4, metavar="N", help="--scenario fleet: simulated engines (default 4)"
    )
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    return p


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.exists("/proc/self/stat"):
        print("infertap bench: needs Linux /proc to read infertap's CPU time and memory", file=sys.stderr)
        return 2
    if args.rounds is not None and args.rounds < 1:
        print("infertap bench: --rounds must be at least 1", file=sys.stderr)
        return 2
    if args.rate and any(r <= 0 for r in args.rate):
        print("infertap bench: --rate must be positive (streams per second)", file=sys.stderr)
        return 2
    rates = tuple(args.rate) if args.rate else POISSON_RATES
    chosen = [
        s for s in scenarios(args.quick, rates, args.rounds) if not args.scenario or s.name in args.scenario
    ]
    nginx = None if args.no_nginx else find_nginx()
    if nginx is None:
        why = "--no-nginx" if args.no_nginx else f"nginx is not installed: {INSTALL_HINT}"
        chosen = [
            Scenario(s.name, s.title, tuple(t for t in s.targets if t != NGINX), s.phases, s.rounds)
            for s in chosen
        ]
    router = None if args.no_vllm_router else find_vllm_router()
    if router is None:
        router_why = (
            "--no-vllm-router" if args.no_vllm_router else f"vllm-router is not installed: {VLLM_ROUTER_HINT}"
        )
        chosen = [
            Scenario(s.name, s.title, tuple(t for t in s.targets if t != VLLM_ROUTER), s.phases, s.rounds)
            for s in chosen
        ]
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the processes the bench started stop too.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)
    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    # 1,000 held streams are ~2,000 sockets in the load generator and the upstream too; they
    # inherit this raised limit (and raise their own). infertap starts with the limit as it was.
    now = raise_nofile()
    want_fleet = bool(args.scenario) and "fleet" in args.scenario
    bench = Bench(args.quick, nofile=before, nginx=nginx, vllm_router=router)
    if nginx is None:
        bench.notes.append(f"no nginx row ({why})")
    if router is None:
        bench.notes.append(f"no vllm-router row ({router_why})")
    started = time.perf_counter()
    try:
        results: dict[str, Any] = {}
        if chosen:
            bench.start({t for s in chosen for t in s.targets})
            results = {s.name: bench.scenario(s) for s in chosen}
        if want_fleet:
            if not chosen:  # the fleet's processes are not pinned: the report must not say so
                bench.harness_cpu = bench.proxy_cpu = None
            rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
            results["fleet"] = run_fleet(args.replicas, args.quick, rounds, router, log)
        machine = _machine(bench, (before, now))
    except BenchError as e:
        print(f"infertap bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        bench.close()
    checks = [
        t.judge({(r["phase"], r["target"]): r for r in results[t.scenario]["rows"]})
        for t in targets() + fleet_targets()
        if t.scenario in results
    ]
    report = {
        "quick": args.quick,
        "duration_s": round(time.perf_counter() - started, 1),
        "machine": machine,
        "scenarios": results,
        "checks": checks,
    }
    print(render(report, args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        log(f"wrote {args.json}")
    failed, messages = exit_status(results)
    for message in messages:
        print(f"infertap bench: {message}", file=sys.stderr)
    return 1 if failed else 0


def _reference(target: str) -> bool:
    """nginx's and vllm-router's rows (any policy): the yardsticks, not what the bench tests."""
    return target.split(" ", 1)[0] in (NGINX, VLLM_ROUTER)


def exit_status(results: dict[str, Any]) -> tuple[int, list[str]]:
    """(requests failed through infertap or direct, what to say): a reference's failures are
    reported and leave the status alone: a third-party router that fails under a loaded CI
    machine says nothing about infertap, while its row and the checks against it show it."""
    rows = [r for sc in results.values() for r in sc["rows"]]
    failed = sum(r["errors"] for r in rows if not _reference(r["target"]))
    messages = []
    if failed:
        messages.append(f"{failed} request(s) failed; the error kinds are in the tables' rows")
    for r in rows:
        if r["errors"] and _reference(r["target"]):
            kinds = ", ".join(f"{k} {n}" for k, n in r.get("error_kinds", {}).items())
            messages.append(
                f"{r['errors']} request(s) through {r['target']} failed ({r['phase']}: {kinds}); a "
                "reference row, reported without failing the run"
            )
    return failed, messages
