"""`infertap bench --scenario fleet`: N simulated engines, each with a bounded prefix cache, and
the ways of spreading a workload over them, measured by what the engines themselves count.

Rows (each workload, in rounds that rotate their order; a row is the median of its rounds):
  oracle               straight to the sims, each conversation always to one replica (chat only)
  direct round_robin   straight to the sims, turn after turn to the next replica
  infertap <policy>    one infertap, a pool of the sims (`replicas = [...]`, `balance = <policy>`)
  vllm-router <policy> vLLM's own router in front of the same sims
Columns: the sims' prefix-cache hit rate (vllm:prefix_cache_hits_total / queries_total, deltas
over the row's run, summed over the replicas), TTFT p50/p95/p99 at the client, and the load per
replica (requests each sim finished; max / mean).

Workloads: `chat` (conversations whose history grows every turn, fleet_load.py), `skew` (single
turns of distinct prompts at a higher concurrency, replica 0 made 2x slower and every replica
limited to a few sequences at once, so that a replica's queue shows in TTFT) and, last, `kill`
(infertap rows only, fleet_kill.py and fleet_kill_rows.py: streams through a fresh infertap while
one sim is SIGKILLed and started again on its port; the client counts the requests that failed
before their first token and the streams cut with the error event, infertap's /metrics show the
replica ejected and readmitted; those figures are in a note under the table).
"""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

from proxy.sim.config import STEP_COSTS, SimConfig, slowed
from proxy.tools.bench.fleet_kill import circuit_section, kill_workload
from proxy.tools.bench.fleet_kill_rows import kill_targets, measure_kill
from proxy.tools.bench.fleet_load import Outcome, Route, Workload, run_workload
from proxy.tools.bench.processes import BenchError, Infertap, _popen, _stop
from proxy.tools.bench.targets import Target
from proxy.tools.bench.vllm_router import POLICIES as ROUTER_POLICIES
from proxy.tools.bench.vllm_router import VllmRouter
from proxy.tools.probe.stats import percentile

ORACLE, DIRECT_RR = "oracle", "direct round_robin"
BALANCE = ("least_request", "round_robin", "prefix_affinity")
SIM_BLOCKS = 600
SKEW_SLOWDOWN = 2.0
SKEW_MAX_SEQS = 4
_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
_DONE = "vllm:e2e_request_latency_seconds_count"


def workloads(quick: bool, replicas: int) -> tuple[Workload, Workload]:
    if quick:
        return (
            Workload("chat", 4, 2, 2, system_tokens=200, output_tokens=4, stagger_s=0.01, think_s=0.01),
            Workload("skew", 8, 1, 4, system_tokens=100, output_tokens=4, stagger_s=0.01),
        )
    return (
        Workload("chat", conversations=16, turns=4, concurrency=8, system_tokens=1200),
        # Arrivals faster than the pool serves: the concurrency limit, not the arrivals, paces it.
        Workload("skew", 12 * replicas, 1, 4 * replicas, system_tokens=400, stagger_s=0.02),
    )


class Sim:
    """`infertap sim` with a prefix cache of SIM_BLOCKS blocks, on a free port (the same one again
    when the kill workload starts it after killing it)."""

    def __init__(self, index: int, directory: Path) -> None:
        self.config = directory / f"sim-{index}.toml"
        self.config.write_text(
            f"[kv_cache]\nnum_gpu_blocks = {SIM_BLOCKS}\n\n[sim]\nseed = {index}\naccept_any_model = true\n"
        )
        self.port = 0
        self.spawn()
        self.ready()

    def spawn(self) -> None:
        """Starts the process (on `self.port`: 0 the first time); ready() waits until it listens."""
        cmd = [sys.executable, "-m", "proxy", "sim", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--config", str(self.config)]
        self.proc = _popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on " not in line:
            self.close()
            raise BenchError(f"a simulated engine did not start (said {line!r}); try `infertap sim`")
        self.url = line.rsplit("listening on ", 1)[1].strip()  # http://127.0.0.1:PORT/v1
        self.port = int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def kill(self) -> None:
        """SIGKILL, as a crashed engine: its connections reset, its streams cut mid-way."""
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body, {"content-type": "application/json"} if body else {})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise BenchError(f"sim {self.url}: {method} {path}: HTTP {resp.status}: {data[:200]!r}")
            return data
        finally:
            conn.close()

    def counters(self) -> dict[str, float]:
        """The series the fleet's columns come from, summed over their labels."""
        out = dict.fromkeys((_HITS, _QUERIES, _DONE), 0.0)
        for line in self._request("GET", "/metrics").decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def set_timing(self, slowdown: float, max_num_seqs: int) -> None:
        sim = slowed(SimConfig(), slowdown).sim
        change = {"sim": {k: getattr(sim, k) for k in STEP_COSTS}, "batching": {"max_num_seqs": max_num_seqs}}
        self._request("POST", "/admin/timing", json.dumps(change).encode())

    def close(self) -> None:
        _stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _pool_config(directory: Path, sims: list[Sim], policy: str, name: str = "", extra: str = "") -> str:
    """`extra`: more sections (the kill workload's [circuit])."""
    path = directory / f"infertap-{name or policy}.toml"
    urls = ", ".join(json.dumps(s.url) for s in sims)
    path.write_text(
        '[server]\nhost = "127.0.0.1"\n\n[[upstreams]]\nname = "fleet"\nmodels = ["*"]\n'
        f'replicas = [{urls}]\nbalance = "{policy}"\n{extra}'
    )
    return str(path)


def _fixed(url: str) -> Route:
    return lambda _conv, _turn: url


class Fleet:
    def __init__(self, replicas: int, vllm_router: str | None, log: Callable[[str], None]) -> None:
        self.log = log
        self.dir = Path(tempfile.mkdtemp(prefix="infertap-bench-fleet-"))
        self.sims: list[Sim] = []
        self.proxies: dict[str, Infertap | VllmRouter] = {}
        self.notes: list[str] = []
        log(f"fleet: starting {replicas} simulated engines ({SIM_BLOCKS} KV blocks each)")
        for i in range(replicas):
            self.sims.append(Sim(i, self.dir))
        urls = [s.url.removesuffix("/v1") for s in self.sims]
        for policy in BALANCE:
            name = f"infertap {policy}"
            self.proxies[name] = Infertap(name, "", None, config=_pool_config(self.dir, self.sims, policy))
        if vllm_router is None:
            self.notes.append(
                "no vllm-router rows: vllm-router is not installed (scripts/install_bench_tools.sh)"
            )
        else:
            for policy in ROUTER_POLICIES:
                name = f"vllm-router {policy}"
                self.proxies[name] = VllmRouter(name, vllm_router, urls, policy)
        for name, proxy in list(self.proxies.items()):
            try:
                proxy.wait_ready()
            except BenchError as e:
                tail = proxy.stderr_tail().strip().splitlines()
                why = tail[-1] if tail else str(e)
                if name.startswith("infertap"):
                    why = f"this infertap refused the pool's config (replica pools, issue 26): {why}"
                self.notes.append(f"no '{name}' row: {why}"[:400])
                proxy.close()
                del self.proxies[name]

    def close(self) -> None:
        for p in self.proxies.values():
            p.close()
        for s in self.sims:
            s.close()

    def routes(self, workload: Workload) -> dict[str, Route]:
        urls = [s.url for s in self.sims]
        turn = count()
        out: dict[str, Route] = {}
        if workload.turns > 1:
            out[ORACLE] = lambda conv, _t: urls[conv % len(urls)]
        out[DIRECT_RR] = lambda _c, _t: urls[next(turn) % len(urls)]
        for name, p in self.proxies.items():
            out[name] = _fixed(f"http://127.0.0.1:{p.port}/v1")
        return out

    def measure(self, workload: Workload, rounds: int, salt: int) -> list[dict[str, Any]]:
        routes = self.routes(workload)
        names = list(routes)
        per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r in range(rounds):
            k = r % len(names)
            for i, name in enumerate(names[k:] + names[:k]):
                self.log(f"fleet {workload.name}: {name}, round {r + 1}/{rounds}")
                before = [s.counters() for s in self.sims]
                outcome = run_workload(routes[name], workload, salt * 1000 + r * 100 + i, seed=r)
                after = [s.counters() for s in self.sims]
                per_round[name].append(_round_row(outcome, before, after))
        return [{"phase": workload.name, "target": n, **_median(per_round[n])} for n in names]


def _round_row(out: Outcome, before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    hits = sum(a[_HITS] - b[_HITS] for a, b in zip(after, before, strict=True))
    queries = sum(a[_QUERIES] - b[_QUERIES] for a, b in zip(after, before, strict=True))
    load = [a[_DONE] - b[_DONE] for a, b in zip(after, before, strict=True)]
    mean = statistics.fmean(load) if load else 0.0
    ttft = {q: percentile(out.ttft, q) * 1000 for q in (50, 95, 99)} if out.ttft else None
    return {
        "requests": out.requests,
        "ok": out.ok,
        "errors": sum(out.errors.values()),
        "error_kinds": dict(out.errors.most_common(5)),
        "hit_rate": hits / queries if queries else None,
        "ttft_ms": ttft,
        "load": load,
        "load_max_over_mean": max(load) / mean if mean else None,
    }


def _med(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts summed, every other number the median of the rounds; the spread of TTFT p50 and of
    the hit rate as [min, max]."""
    ttfts = [r["ttft_ms"] for r in rounds if r["ttft_ms"]]
    kinds: dict[str, int] = {}
    for r in rounds:
        for k, v in r["error_kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    spread: dict[str, list[float]] = {}
    for key, vals in (
        ("ttft_p50", [r["ttft_ms"][50] for r in rounds if r["ttft_ms"]]),
        ("hit_rate", [r["hit_rate"] for r in rounds if r["hit_rate"] is not None]),
    ):
        if vals:
            spread[key] = [min(vals), max(vals)]
    return {
        "rounds": len(rounds),
        "requests": sum(r["requests"] for r in rounds),
        "ok": sum(r["ok"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "error_kinds": kinds,
        "hit_rate": _med([r["hit_rate"] for r in rounds]),
        "ttft_ms": {f"p{q}": _med([t[q] for t in ttfts]) for q in (50, 95, 99)} if ttfts else None,
        "load": [_med([r["load"][i] for r in rounds]) for i in range(len(rounds[0]["load"]))],
        "load_max_over_mean": _med([r["load_max_over_mean"] for r in rounds]),
        "spread": spread,
    }


def run_fleet(
    replicas: int, quick: bool, rounds: int, vllm_router: str | None, log: Callable[[str], None]
) -> dict[str, Any]:
    """The fleet scenario's result: {"kind": "fleet", "title", "rows", "notes"}."""
    if replicas < 2:
        raise BenchError("--replicas: a fleet needs at least 2")
    chat, skew = workloads(quick, replicas)
    fleet = Fleet(replicas, vllm_router, log)
    try:
        rows = fleet.measure(chat, rounds, salt=1)
        for i, sim in enumerate(fleet.sims):  # replica 0 on a slower GPU, and short queues
            sim.set_timing(SKEW_SLOWDOWN if i == 0 else 1.0, SKEW_MAX_SEQS)
        rows += fleet.measure(skew, rounds, salt=2)
        default_seqs = SimConfig().batching.max_num_seqs
        for sim in fleet.sims:  # as a restarted sim comes back
            sim.set_timing(1.0, default_seqs)
        kill = kill_workload(quick, replicas)

        def config(policy: str) -> str:
            return _pool_config(fleet.dir, fleet.sims, policy, f"kill-{policy}", circuit_section())

        kill_rows, kill_notes = measure_kill(fleet.sims, config, kill, rounds, log)
        rows += kill_rows
        notes = fleet.notes + [
            f"chat: {chat.conversations} conversations of a ~{chat.system_tokens}-token system prompt and "
            f"{chat.turns} turns, {chat.concurrency} at a time, arriving {chat.stagger_s:g} s apart on "
            f"average (Poisson), the user thinking {chat.think_s:g} s on average between turns",
            f"skew: {skew.conversations} single turns of distinct ~{skew.system_tokens}-token prompts, "
            f"{skew.concurrency} at a time; replica 0 {SKEW_SLOWDOWN:g}x slower, max_num_seqs "
            f"{SKEW_MAX_SEQS} on every replica",
            *kill_notes,
            "not pinned: the sims, the routers and the client share every core",
        ]
    finally:
        fleet.close()
    title = f"{replicas} simulated engines ({SIM_BLOCKS} KV blocks each) behind each balancing policy"
    return {"kind": "fleet", "title": title, "rows": rows, "notes": notes}


Rows = dict[tuple[str, str], dict[str, Any]]


def _of(rows: Rows, phase: str, target: str, key: str, q: str | None = None) -> float:
    v = rows[phase, target][key]
    return float(v[q] if q else v)


def _vs_round_robin(rows: Rows, phase: str, target: str, q: str) -> float:
    """target's TTFT quantile over round_robin's: infertap's round_robin row, else the direct one."""
    rr = "infertap round_robin" if (phase, "infertap round_robin") in rows else DIRECT_RR
    return _of(rows, phase, target, "ttft_ms", q) / _of(rows, phase, rr, "ttft_ms", q)


def fleet_targets() -> list[Target]:
    """Issue 26's targets (n/a where the infertap rows could not run)."""
    pa, lr = "infertap prefix_affinity", "infertap least_request"
    return [
        Target(
            "chat: prefix_affinity's hit rate / the oracle's", "fleet", "x", 0.9, False,
            lambda r: _of(r, "chat", pa, "hit_rate") / _of(r, "chat", ORACLE, "hit_rate"),
        ),
        Target(
            "chat: prefix_affinity's TTFT p50 / round_robin's", "fleet", "x", 0.7, True,
            lambda r: _vs_round_robin(r, "chat", pa, "p50"),
        ),
        Target(
            "chat: prefix_affinity's busiest replica / the mean", "fleet", "x", 1.3, True,
            lambda r: _of(r, "chat", pa, "load_max_over_mean"),
        ),
        Target(
            "chat: prefix_affinity's hit rate - vllm-router cache_aware's", "fleet", "", 0.0, False,
            lambda r: _of(r, "chat", pa, "hit_rate") - _of(r, "chat", "vllm-router cache_aware", "hit_rate"),
        ),
        Target(
            "skew: least_request's TTFT p99 / round_robin's", "fleet", "x", 0.7, True,
            lambda r: _vs_round_robin(r, "skew", lr, "p99"),
        ),
        *kill_targets(),
    ]  # fmt: skip
