"""promtool tests for the spend alert; `python deploy/generate.py` writes spend.test.yml from them.

One client spends above its daily budget (the alert fires with its labels and annotations), one below
(silent), one has no budget at all (silent), and a short burst that the hour's rate averages under
budget is silent too.
"""

from __future__ import annotations

import re
from typing import Any

MIN, HOUR, DAY = 60, 3600, 86400
BUDGET = 10.0  # per day
ABOVE = 1.5 * BUDGET / DAY  # per second: 15 a day
BELOW = 0.8 * BUDGET / DAY  # 8 a day
FILES = ("spend.test.yml",)


def _counter(per_s: float, steps: int, interval: int, start: int = 0, stop: int | None = None) -> str:
    """A counter growing by per_s * interval each step from `start` (step index) to `stop`."""
    inc = per_s * interval
    stop = steps if stop is None else stop
    parts = [f"0x{start}"] if start else []
    parts.append(f"0+{inc:.10g}x{stop - start}")
    if stop < steps:
        parts.append(f"{inc * (stop - start):.10g}x{steps - stop}")
    return " ".join(parts)


def _series(client: str, values: str) -> dict[str, str]:
    return {
        "series": f'infertap_spend_total{{client="{client}",model="deepseek-chat",upstream="taotoken"}}',
        "values": values,
    }


def _budget(client: str, steps: int) -> dict[str, str]:
    return {"series": f'infertap_spend_daily_budget{{client="{client}"}}', "values": f"{BUDGET:g}x{steps}"}


def _render(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def test_file(name: str, alerts: dict[str, dict[str, Any]], groups: list[str]) -> dict[str, Any]:
    rule = alerts["InfertapClientOverBudget"]
    interval, dur = MIN, 4 * HOUR
    steps = dur // interval
    fired = {"client": "big-spender", "severity": "warning"}
    expected = {
        "exp_labels": fired,
        "exp_annotations": {k: _render(v, fired) for k, v in rule["annotations"].items()},
    }
    inputs = [
        _series("big-spender", _counter(ABOVE, steps, interval)),
        _budget("big-spender", steps),
        _series("thrifty", _counter(BELOW, steps, interval)),
        _budget("thrifty", steps),
        _series("no-budget", _counter(100 * ABOVE, steps, interval)),
        # 10 minutes at 3x the over-budget rate, then nothing: the hour's average stays under budget.
        _series("burst", _counter(ABOVE * 3, steps, interval, start=60, stop=70)),
        _budget("burst", steps),
    ]
    evals = [
        ("20m", []),  # not yet for 30 minutes above
        ("2h", [expected]),
        ("4h", [expected]),
    ]
    return {
        "rule_files": ["../rules/infertap-spend.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": "one client above its daily budget, one below, one without a budget, one short burst",
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": t, "alertname": "InfertapClientOverBudget", "exp_alerts": exp}
                    for t, exp in evals
                ],
            }
        ],
    }
