"""One bench run: the processes it starts (upstream, load generator, infertap, nginx) and the
rounds of each scenario, measured and reduced to one row per target and phase.

The command line and the report around it are in cli.py; why the bench pins cores, rotates
targets and takes medians is in cli.py's docstring and docs/benchmarks.md.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

from proxy.tools.bench.loadgen import Job
from proxy.tools.bench.nginx import Nginx
from proxy.tools.bench.processes import (
    Infertap,
    LoadGenerator,
    Upstream,
    affinity,
    cpu_seconds,
    free_port,
    open_files_limit,
    reset_peak_rss,
    status_mb,
)
from proxy.tools.bench.report import DIRECT, NGINX, VLLM_ROUTER, Acc, make_row, median_row, ratio
from proxy.tools.bench.scenarios import (
    BENCH_KEY,
    DEAD_COLLECTOR,
    LOOPS_ON,
    OVERHEAD_OFF,
    SPEND_ENV,
    SPEND_ON,
    TRACE_FLUSH_S,
    TRACED,
    UI_OFF,
    WORKERS,
    Phase,
    Scenario,
)
from proxy.tools.bench.vllm_router import VllmRouter

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:5.1f}s] {msg}", file=sys.stderr, flush=True)


class Bench:
    """The processes of one run, started once, and the scenarios run against them in rounds."""

    def __init__(
        self, quick: bool, nofile: int | None = None, nginx: str | None = None, vllm_router: str | None = None
    ) -> None:
        self.quick = quick
        self.nginx = nginx  # nginx's executable; None: no nginx row
        self.vllm_router = vllm_router  # vllm-router's executable; None: no vllm-router row
        self.nofile = nofile  # the soft open-file limit infertap starts with, as a user's would
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        # Core 0: upstream + load generator; core 1: infertap. One core: nothing to separate.
        self.harness_cpu: int | None = cpus[0] if len(cpus) >= 2 else None
        self.proxy_cpu: int | None = cpus[1] if len(cpus) >= 2 else None
        self.notes: list[str] = []
        if self.proxy_cpu is None:
            self.notes.append(
                f"not pinned: {len(cpus) or 'unknown'} usable core(s); harness and infertap share"
            )
        self.upstream: Upstream | None = None
        self.loadgen: LoadGenerator | None = None
        self.proxies: dict[str, Infertap | Nginx | VllmRouter] = {}

    # --- processes ---

    def start(self, needed: set[str]) -> None:
        log("starting the bench upstream and the load generator")
        self.upstream = Upstream(self.harness_cpu)
        self.loadgen = LoadGenerator(self.harness_cpu)
        url = self.upstream.url
        for name in sorted(needed - {DIRECT}):
            log(f"starting {name}")
            if name == NGINX:
                assert self.nginx is not None
                proxy: Infertap | Nginx | VllmRouter = Nginx(
                    name, self.nginx, self.upstream.port, self.proxy_cpu, self.nofile
                )
            elif name == VLLM_ROUTER:
                assert self.vllm_router is not None
                proxy = VllmRouter(name, self.vllm_router, [url], "round_robin", self.proxy_cpu, self.nofile)
            elif name == TRACED:
                flush_ms = int(TRACE_FLUSH_S * 1000)
                proxy = Infertap(
                    name, url, self.proxy_cpu, tracing_to=url, flush_ms=flush_ms, nofile=self.nofile
                )
            elif name == DEAD_COLLECTOR:
                dead = f"http://127.0.0.1:{free_port()}"  # bound and closed again: nothing listens
                proxy = Infertap(
                    name,
                    url,
                    self.proxy_cpu,
                    tracing_to=dead,
                    flush_ms=int(TRACE_FLUSH_S * 1000),
                    nofile=self.nofile,
                )
            elif name == UI_OFF:
                proxy = Infertap(
                    name, url, self.proxy_cpu, nofile=self.nofile, extra_env={"INFERTAP_UI__ENABLED": "false"}
                )
            elif name == LOOPS_ON:
                proxy = Infertap(
                    name,
                    url,
                    self.proxy_cpu,
                    nofile=self.nofile,
                    extra_env={"INFERTAP_LOOPS__ENABLED": "true"},
                )
            elif name == OVERHEAD_OFF:
                off = {"INFERTAP_METRICS__OVERHEAD": "false"}
                proxy = Infertap(name, url, self.proxy_cpu, nofile=self.nofile, extra_env=off)
            elif name == SPEND_ON:
                proxy = Infertap(name, url, self.proxy_cpu, nofile=self.nofile, extra_env=SPEND_ENV)
            elif name == WORKERS:
                proxy = Infertap(name, url, None, workers=2, nofile=self.nofile)
            else:
                proxy = Infertap(name, url, self.proxy_cpu, nofile=self.nofile)
            self.proxies[name] = proxy
        # Started together, waited for together: start-up is import-bound, the waits overlap.
        for p in self.proxies.values():
            p.wait_ready()
        if self.proxy_cpu is not None and any(
            affinity(p.proc.pid) != {self.proxy_cpu} for name, p in self.proxies.items() if name != WORKERS
        ):
            self.notes.append("could not pin infertap to its core (sched_setaffinity failed)")

    def close(self) -> None:
        # The load generator first: once its connections are gone, infertap shuts down at once
        # instead of waiting out its graceful-shutdown period for open streams.
        if self.loadgen is not None:
            self.loadgen.close()
        for p in self.proxies.values():
            p.close()
        if self.upstream is not None:
            self.upstream.close()

    def _port(self, target: str) -> int:
        assert self.upstream is not None
        return self.upstream.port if target == DIRECT else self.proxies[target].port

    # --- measuring ---

    def _job(self, phase: Phase, target: str, count: int, warmup: bool = False, seed: int = 0) -> Job:
        key = BENCH_KEY if target == SPEND_ON else ""
        if warmup:  # zero delays, short: opens connections and warms caches without taking long
            c = min(phase.concurrency, 16 if self.quick else 64)
            return Job(
                "127.0.0.1", self._port(target), phase.stream, c, 2 * c, tokens=10, timeout_s=30,
                authorization=key,
            )  # fmt: skip
        budget = (phase.ttft_ms + phase.itl_ms * phase.tokens) / 1000
        return Job(
            "127.0.0.1", self._port(target), phase.stream, phase.concurrency, count,
            phase.ttft_ms, phase.itl_ms, phase.tokens, timeout_s=budget + 60, authorization=key,
            rate=phase.rate, seed=seed,
        )  # fmt: skip

    def _run(self, job: Job, phase: Phase, target: str, acc: Acc | None) -> None:
        assert self.loadgen is not None and self.upstream is not None
        proxy = self.proxies.get(target)
        pids = proxy.refresh_pids() if proxy else []
        cpu0, main0 = cpu_seconds(pids), cpu_seconds(pids, main_thread=True)
        self.loadgen.start(job)
        if phase.hold and acc is not None and proxy is not None:
            acc.extra.update(self._held(phase, pids))
        arrivals = job.count / job.rate if job.rate else 0.0
        result = self.loadgen.result(job.timeout_s * max(1, job.count // job.concurrency) + arrivals + 60)
        if target == TRACED:
            self._settle_traces()
        cpu1, main1 = cpu_seconds(pids), cpu_seconds(pids, main_thread=True)
        if acc is not None:
            acc.add(result, cpu1 - cpu0 if proxy else None, main1 - main0 if proxy else None)

    def _nofile_note(self, target: str, streams: int) -> str:
        """infertap started with the soft open-file limit the bench was given: did it raise it?"""
        limit = open_files_limit(self.proxies[target].proc.pid)
        if limit is None or self.nofile is None:
            return f"{target}: open-file limit unknown"
        if limit > self.nofile:
            said = f"infertap raised its open-file limit itself, from {self.nofile} to {limit}"
        elif limit == resource.getrlimit(resource.RLIMIT_NOFILE)[1]:
            said = f"infertap's open-file limit is {limit}, the hard limit already"
        else:
            said = f"infertap kept the soft open-file limit of {limit}: it does not raise it"
        if limit < 2 * streams + 100:  # a client and an upstream socket per stream, plus slack
            said += f"; too few for {streams} streams (raise `ulimit -n`)"
        return f"{target}: {said}"

    def _settle_traces(self) -> None:
        """Wait until the batch span processor has exported the run's spans: that export is part of
        what tracing costs, so it belongs to this run's CPU time, not the next one's."""
        assert self.upstream is not None
        seen = self.upstream.stats()["trace_bytes"]
        for _ in range(20):
            time.sleep(2 * TRACE_FLUSH_S)
            now = self.upstream.stats()["trace_bytes"]
            if now == seen:
                return
            seen = now

    def _held(self, phase: Phase, pids: list[int]) -> dict[str, Any]:
        """Until the load generator is done: how many streams the upstream holds open at once, and
        infertap's RSS at the moment it held the most (the first streams may end before the last
        arrive on a slow machine, so the peak is tracked rather than waited for)."""
        assert self.upstream is not None and self.loadgen is not None
        most, rss = 0, 0.0
        while not self.loadgen.ready(0.05):
            now_open = self.upstream.stats()["open_streams"]
            if now_open > most:
                most, rss = now_open, status_mb(pids, "VmRSS")
            elif now_open == most and most:
                rss = max(rss, status_mb(pids, "VmRSS"))
        return {"held_streams": most, "held_rss_mb": rss}

    @staticmethod
    def _round_rows(sc: Scenario, phase: Phase, accs: dict[str, Acc]) -> dict[str, dict[str, Any]]:
        """One round's rows, each compared with the direct and nginx rows of the same round."""
        direct = make_row(sc.name, phase.label, DIRECT, accs[DIRECT], None) if DIRECT in accs else None
        nginx = make_row(sc.name, phase.label, NGINX, accs[NGINX], direct) if NGINX in accs else None
        out: dict[str, dict[str, Any]] = {}
        for t, acc in accs.items():
            out[t] = (
                direct if t == DIRECT and direct else make_row(sc.name, phase.label, t, acc, direct, nginx)
            )
        return out

    def scenario(self, sc: Scenario) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        notes: list[str] = []
        for p in (self.proxies[t] for t in sc.targets if t != DIRECT):
            if not reset_peak_rss(p.refresh_pids()):
                notes.append(f"{p.label}: peak RSS is since start (clear_refs not writable)")
        for phase in sc.phases:
            rounds: list[dict[str, Acc]] = []
            log(f"{sc.name} {phase.label}: warming up")
            for t in sc.targets:
                self._run(self._job(phase, t, 0, warmup=True), phase, t, None)
            for r in range(sc.rounds):
                share = phase.count // sc.rounds + (phase.count % sc.rounds if r == sc.rounds - 1 else 0)
                # Rotated, so that no target always runs first (or right after the same one).
                k = r % len(sc.targets)
                order = sc.targets[k:] + sc.targets[:k]
                accs = {t: Acc() for t in sc.targets}
                for t in order:
                    log(f"{sc.name} {phase.label}: {t}, round {r + 1}/{sc.rounds}, {share} requests")
                    # The round's number seeds the Poisson arrivals: the same for every target.
                    self._run(self._job(phase, t, share, seed=r), phase, t, accs[t])
                rounds.append(accs)
            for t in sc.targets:
                if phase.hold and t in self.proxies:
                    notes.append(self._nofile_note(t, phase.concurrency))
                held = rounds[-1][t].extra.get("held_streams")
                if held is not None and held < phase.concurrency:
                    notes.append(
                        f"{t}: at most {held} of {phase.concurrency} streams were open at once (infertap "
                        "was slow to admit them): the held RSS is for that many"
                    )
            per_round = [self._round_rows(sc, phase, accs) for accs in rounds]
            for t in sc.targets:
                row = median_row([rows[t] for rows in per_round])
                proxy = self.proxies.get(t)
                if proxy is not None:
                    pids = proxy.refresh_pids()
                    row.update(
                        rss_mb=status_mb(pids, "VmRSS"),
                        peak_rss_mb=status_mb(pids, "VmHWM"),
                        pinned=proxy.pinned,
                    )
                rows.append(row)
        if TRACED in sc.targets:
            assert self.upstream is not None
            stats = self.upstream.stats()
            notes.append(f"OTLP sink received {stats['trace_posts']} exports, {stats['trace_bytes']} bytes")
            if not stats["trace_posts"]:
                notes.append("tracing: no spans arrived at the sink; is the OTLP exporter installed?")
            notes.extend(_tracing_threads(rows))
        if NGINX in sc.targets:
            notes.append("nginx: proxy_buffering off, one worker on infertap's core, upstream keep-alive")
        if VLLM_ROUTER in sc.targets:
            notes.append("vllm-router: round_robin to the one upstream, retries off, on infertap's core")
        if WORKERS in sc.targets:
            notes.append("--workers 2 is not pinned: its workers share both cores with the harness")
        return {"title": sc.title, "rows": rows, "notes": notes}


def _tracing_threads(rows: list[dict[str, Any]]) -> list[str]:
    """Where tracing's CPU goes: the event loop's thread (the span work per request, the target's)
    and every thread (the exporter's batching and encoding too)."""
    by = {(r["phase"], r["target"]): r for r in rows}
    out = []
    for (phase, target), traced in by.items():
        plain = by.get((phase, "infertap"))
        if target != TRACED or plain is None:
            continue
        loop = ratio(
            traced.get("main_thread_cpu_ms_per_request"), plain.get("main_thread_cpu_ms_per_request")
        )
        every = ratio(traced.get("cpu_ms_per_request"), plain.get("cpu_ms_per_request"))
        if loop is not None and every is not None:
            out.append(
                f"tracing, {phase}: CPU per request on / off {loop:.2f}x in the event loop's thread, "
                f"{every:.2f}x in all threads (the exporter's included)"
            )
    return out
