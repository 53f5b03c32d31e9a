"""scripts/perf/ttft_path.py and ttft_split.py, the probes of a stream's added TTFT.

ttft_path.py patches probes onto infertap's methods by name: each must exist, and be
the kind of function (plain or coroutine) the probe wraps it as, or the script measures nothing."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

from proxy.tools.bench.nginx import find_nginx

ROOT = Path(__file__).resolve().parents[1]


def test_every_checkpoint_names_a_function_infertap_has() -> None:
    spec = importlib.util.spec_from_file_location("ttft_path", ROOT / "scripts/perf/ttft_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    way_in, way_back = module.checkpoints()
    labels = [label for _, _, label in way_in + way_back]
    assert len(labels) == len(set(labels))
    for owner, name, _ in way_in + way_back:
        assert callable(getattr(owner, name)), f"{owner.__name__}.{name}"
    # The way in starts at a coroutine per request; the write upstream is awaited.
    assert any(inspect.iscoroutinefunction(getattr(o, n)) for o, n, _ in way_in)


def test_ttft_split_measures_both_halves_through_every_target() -> None:
    """scripts/perf/ttft_split.py, one short round: a row per target, each with its way in and its
    way back measured (a probe that never saw the upstream's read or the client's first content
    event would fail here, not print a table of zeros)."""
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/perf/ttft_split.py"),
            "1",
            "3",
            "infertap",
            "quiet,INFERTAP_UI__ENABLED=false",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {}
    for line in run.stdout.splitlines()[1:]:
        label, numbers = line[:24].strip(), line[24:].replace("(", " ").replace(")", " ").replace("..", " ")
        rows[label] = [float(x) for x in numbers.split()]
    expected = {"direct", "floor (uvicorn-proto)", "infertap", "quiet"} | (
        {"nginx"} if find_nginx() else set()
    )
    assert set(rows) == expected
    for label, (way_in, _, _, back, _, _, _) in rows.items():
        assert way_in > 0 and back > 0, label
