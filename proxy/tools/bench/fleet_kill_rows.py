"""The kill workload's rows (one per policy, its rounds together), their notes, and issue 26's
targets for it: no request failed before its first token; the killed replica ejected, readmitted.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from proxy.tools.bench.fleet_kill import CIRCUIT, KILLED, KillOutcome, KillWorkload, Replica, run_kill
from proxy.tools.bench.processes import BenchError
from proxy.tools.bench.targets import Target
from proxy.tools.probe.stats import percentile

KILL_POLICIES = ("least_request", "prefix_affinity")
_ERRORS_AFTER_TOKENS = "after tokens: "


def _med(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def kill_row(target: str, runs: list[KillOutcome]) -> dict[str, Any]:
    """The rounds of one policy: counts summed, TTFT and load the median of the rounds."""
    kinds: Counter[str] = Counter()
    for r in runs:
        kinds.update(r.before_first)
        kinds.update({_ERRORS_AFTER_TOKENS + k: v for k, v in r.after_first.items()})
    ttfts = [{q: percentile(r.ttft, q) * 1000 for q in (50, 95, 99)} for r in runs if r.ttft]
    ratios = [max(r.load) / statistics.fmean(r.load) for r in runs if r.load and sum(r.load)]
    p50s = [t[50] for t in ttfts]
    return {
        "phase": "kill",
        "target": target,
        "rounds": len(runs),
        "requests": sum(r.requests for r in runs),
        "ok": sum(r.ok for r in runs),
        # The streams cut with the error event are what issue 26 expects, not failures of the bench.
        "errors": sum(kinds.values()),
        "error_kinds": dict(kinds.most_common(5)),
        "failed_before_first_token": sum(sum(r.before_first.values()) for r in runs),
        "interrupted_with_error_event": sum(r.interrupted for r in runs),
        "killed_replica": KILLED,
        "ejected": all(r.ejected_s is not None for r in runs),
        "readmitted": all(r.readmitted_s is not None for r in runs),
        "ejected_after_s": [r.ejected_s for r in runs],
        "restarted_after_s": [r.restarted_s for r in runs],
        "readmitted_after_s": [r.readmitted_s for r in runs],
        "served_after_restart": [r.served_after_restart for r in runs],
        "retries": sum(r.decisions.get("retry", 0.0) for r in runs),
        "hit_rate": None,  # distinct single turns: nothing to cache
        "ttft_ms": {f"p{q}": _med([t[q] for t in ttfts]) for q in (50, 95, 99)} if ttfts else None,
        "load": [_med([r.load[i] for r in runs]) for i in range(len(runs[0].load))],
        "load_max_over_mean": _med(ratios),
        "spread": {"ttft_p50": [min(p50s), max(p50s)]} if p50s else {},
    }


def measure_kill(
    sims: Sequence[Replica],
    config: Callable[[str], str],
    w: KillWorkload,
    rounds: int,
    log: Callable[[str], None],
) -> tuple[list[dict[str, Any]], list[str]]:
    """The kill rows (one per policy of KILL_POLICIES, `config(policy)` its infertap's config) and
    their notes."""
    runs: dict[str, list[KillOutcome]] = {f"infertap {p}": [] for p in KILL_POLICIES}
    names = list(runs)
    for r in range(rounds):
        k = r % len(names)
        for i, name in enumerate(names[k:] + names[:k]):
            log(f"fleet kill: {name}, round {r + 1}/{rounds}")
            try:
                runs[name].append(run_kill(sims, config(name.split()[1]), name, w, 3000 + r * 100 + i))
            except BenchError as e:
                return [], [f"no kill rows: {e}"[:400]]
    rows = [kill_row(n, runs[n]) for n in names]
    return rows, [kill_description(w)] + [kill_note(row) for row in rows]


def kill_description(w: KillWorkload) -> str:
    circuit = ", ".join(f"{k} {v:g}" for k, v in CIRCUIT.items())
    return (
        f"kill: streaming single turns of distinct ~{w.prompt_tokens}-token prompts, {w.output_tokens} "
        f"tokens out, {w.concurrency} at a time (a closed loop, its workers starting {w.stagger_s:g} s "
        f"apart); when request {w.kill_after} starts, replica {KILLED} gets SIGKILL, is started again "
        f"on its port once infertap ejected it and {w.down_s:g} s passed, and the load stops once "
        f"infertap readmitted it and it answered {w.served_after} more; a fresh infertap per run, "
        f"[circuit] {circuit} (defaults 20, 30 s, 30 s); default timing on every sim; requests per "
        "replica here = infertap's ok answers per replica (infertap_replica_requests_total)"
    )


def _times(values: list[float | None]) -> str:
    return "/".join("-" if v is None else f"{v:.1f}" for v in values)


def kill_note(row: dict[str, Any]) -> str:
    return (
        f"kill {row['target']}: {row['requests']} requests, {row['ok']} ok, "
        f"{row['failed_before_first_token']} failed before their first token, "
        f"{row['interrupted_with_error_event']} cut mid-stream with the error event, "
        f"{row['errors'] - row['failed_before_first_token']} other failures, {row['retries']:.0f} "
        f"retries; replica {row['killed_replica']} ejected {_times(row['ejected_after_s'])} s after "
        f"the kill, started again at {_times(row['restarted_after_s'])} s, readmitted at "
        f"{_times(row['readmitted_after_s'])} s, then answered "
        f"{'/'.join(str(n) for n in row['served_after_restart'])} (per round)"
    )


Rows = dict[tuple[str, str], dict[str, Any]]


def _kill_rows(rows: Rows) -> list[dict[str, Any]]:
    found = [row for (phase, _), row in rows.items() if phase == "kill"]
    if not found:
        raise KeyError("kill")  # judged n/a
    return found


def failed_before_first_token(rows: Rows) -> float:
    return float(sum(r["failed_before_first_token"] for r in _kill_rows(rows)))


def ejected_and_readmitted(rows: Rows) -> float:
    """1 when every run saw the killed replica ejected and then readmitted, else 0."""
    return float(all(r["ejected"] and r["readmitted"] for r in _kill_rows(rows)))


def kill_targets() -> list[Target]:
    """Issue 26's: no request fails before its first token; the replica ejected, then readmitted."""
    return [
        Target("kill: requests failed before their first token", "fleet", "", 0.0, True,
               failed_before_first_token),
        Target("kill: the killed replica ejected and readmitted", "fleet", "", 1.0, False,
               ejected_and_readmitted),
    ]  # fmt: skip
