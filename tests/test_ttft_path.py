"""scripts/perf/ttft_path.py patches probes onto infertap's methods by name: each must exist, and be
the kind of function (plain or coroutine) the probe wraps it as, or the script measures nothing."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

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
