"""The architecture's import contracts (pyproject.toml's [tool.importlinter]) hold, and they catch what
they are there for: each deliberate violation below, made in a copy of the package, breaks one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(root: Path, contract: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    only = ["--contract", contract] if contract else []
    return subprocess.run(
        [LINT, str(root / "pyproject.toml"), "--no-cache", "--no-logo", *only],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_contracts_hold() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_module_sits_flat_in_the_package_but_the_entry_modules() -> None:
    flat = sorted(p.name for p in (ROOT / "proxy").glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "app.py"]


# (module to change, the line added, the id of the contract that must break)
VIOLATIONS = [
    ("core/exchange.py", "import proxy.observe.metrics", "planes"),
    ("core/hooks.py", "from proxy.control import drain", "planes"),
    ("observe/spend.py", "import proxy.transport", "planes"),
    ("observe/spend.py", "import proxy.api.ops", "planes"),
    ("settings/sections.py", "import proxy.core.errors", "planes"),
    ("core/route_table.py", "import proxy.core.forward.relay", "acyclic"),
    (
        "core/forward/intake.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proxy.core.forward import forwarder",
        "acyclic",
    ),
    ("core/sse.py", "import httpx", "core-pure"),
    ("core/sse.py", "import prometheus_client", "core-pure"),
    ("control/drain.py", "import aiohttp", "aiohttp-in-transport"),
    ("control/drain.py", "import httptools", "httptools-in-transport-and-server"),
    ("api/ops.py", "from httptools import HttpResponseParser", "httptools-in-transport-and-server"),
    ("observe/spend.py", "import prometheus_client", "prometheus-in-metrics"),
    ("observe/access_log.py", "import opentelemetry.trace", "otel-in-tracing"),
]


@pytest.mark.parametrize(
    ("module", "line", "contract"), VIOLATIONS, ids=[v[0] + ": " + v[1] for v in VIOLATIONS]
)
def test_a_deliberate_violation_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    shutil.copytree(
        ROOT / "proxy", tmp_path / "proxy", ignore=shutil.ignore_patterns("__pycache__", "static")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint(tmp_path, contract).returncode == 0, "the unchanged copy must keep the contract"
    target = tmp_path / "proxy" / module
    source = target.read_text()
    # After the module's own imports (before its first definition), where a real import would go.
    head, sep, rest = source.partition("\n\n\n")
    target.write_text(f"{head}\n{line}\n{sep}{rest}")
    result = lint(tmp_path, contract)
    assert result.returncode != 0, f"{module}: `{line}` did not break {contract}:\n{result.stdout}"
    assert "BROKEN" in result.stdout, result.stdout
