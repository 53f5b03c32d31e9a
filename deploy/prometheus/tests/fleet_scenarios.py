"""promtool tests for the fleet alert; `python deploy/generate.py` writes fleet.test.yml from them.

A pool of four replicas. One replica 4x slower than the others fires (with its labels and annotations);
the whole pool slow together (the model, not a GPU), a slow replica with almost no traffic, and a
replica 3x slower but under the 0.25 s floor stay silent.
"""

from __future__ import annotations

import math
import re
from typing import Any

MIN, HOUR = 60, 3600
NAMESPACE, UPSTREAM = "llm", "vllm"
REPLICAS = tuple(f"10.0.0.1{i}:8000" for i in range(1, 5))
LE = (0.1, 0.25, 0.5, 1.0, 2.0, math.inf)
FILES = ("fleet.test.yml",)


def _counter(inc: float, steps: int) -> str:
    return f"0+{inc:.10g}x{steps}"


def _histogram(replica: str, rate: float, ttft: float, interval: int, steps: int) -> list[dict[str, str]]:
    """Every request of `replica` at `ttft` seconds, `rate` a second, from the start, on two infertap pods
    (each sends half: the rules sum them)."""
    out = []
    per_step = rate * interval / 2
    for pod in ("infertap-0", "infertap-1"):
        lbl = f'job="infertap",namespace="{NAMESPACE}",pod="{pod}",upstream="{UPSTREAM}",replica="{replica}"'
        for le in LE:
            le_s = "+Inf" if le == math.inf else f"{le:g}"
            out.append(
                {
                    "series": f'infertap_replica_time_to_first_token_seconds_bucket{{{lbl},le="{le_s}"}}',
                    "values": _counter(per_step if ttft <= le else 0.0, steps),
                }
            )
        out.append(
            {
                "series": f"infertap_replica_time_to_first_token_seconds_count{{{lbl}}}",
                "values": _counter(per_step, steps),
            }
        )
        out.append(
            {
                "series": f"infertap_replica_time_to_first_token_seconds_sum{{{lbl}}}",
                "values": _counter(per_step * ttft, steps),
            }
        )
    return out


def _render(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


# name -> (per replica: (requests/s, TTFT s)), whether REPLICAS[2] fires
CASES: dict[str, tuple[tuple[tuple[float, float], ...], bool]] = {
    "one replica 4x slower than its pool": (((1, 0.3), (1, 0.3), (1, 1.5), (1, 0.3)), True),
    "the whole pool slow together: the model, not a GPU": (((1, 1.5),) * 4, False),
    "a slow replica with almost no traffic": (((1, 0.3), (1, 0.3), (0.01, 1.5), (1, 0.3)), False),
    "a fast pool: one replica 3x slower, under the floor": (
        ((1, 0.03), (1, 0.03), (1, 0.09), (1, 0.03)),
        False,
    ),
}


def test_file(name: str, alerts: dict[str, dict[str, Any]], groups: list[str]) -> dict[str, Any]:
    rule = alerts["InfertapReplicaSlow"]
    interval, dur = MIN, 2 * HOUR
    steps = dur // interval
    fired = {"namespace": NAMESPACE, "upstream": UPSTREAM, "replica": REPLICAS[2], "severity": "warning"}
    expected = {
        "exp_labels": fired,
        "exp_annotations": {k: _render(v, fired) for k, v in rule["annotations"].items()},
    }
    tests = []
    for title, (replicas, fires) in CASES.items():
        inputs = [
            s
            for replica, (rate, ttft) in zip(REPLICAS, replicas, strict=True)
            for s in _histogram(replica, rate, ttft, interval, steps)
        ]
        # 8m: not yet 10 minutes above (the rates start at 1m)
        evals = [("8m", []), ("1h", [expected] if fires else []), ("2h", [expected] if fires else [])]
        tests.append(
            {
                "name": title,
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": t, "alertname": "InfertapReplicaSlow", "exp_alerts": exp}
                    for t, exp in evals
                ],
            }
        )
    return {
        "rule_files": ["../rules/infertap-fleet.yml"],
        "evaluation_interval": "1m",
        "group_eval_order": groups,
        "tests": tests,
    }
