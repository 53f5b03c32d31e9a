"""A short soak: concurrent streams with faults, every byte checked (docs/resilience.md: a long run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.tools.soak import build_parser, run_soak


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_short_soak_loses_nothing() -> None:
    args = build_parser().parse_args(
        ["--streams", "150", "--concurrency", "16", "--events", "10", "--fault-rate", "0.3", "--no-progress"]
    )
    report = run_soak(args)
    assert report.ok, report.problems[:10]
    assert report.verified_identical + report.errors_visible == 150
    assert report.verified_identical > 90 and report.errors_visible > 20
    assert report.in_flight_end == 0
