"""Write constraints.txt: the versions of infertap's runtime dependencies (and theirs) installed in this
environment, for image builds (`pip install -c constraints.txt .` in the Dockerfile).

    scripts/bootstrap test && .venv/bin/python scripts/pin_constraints.py

Run it after changing pyproject.toml's dependencies, then run the tests: CI tests exactly these versions.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# The image's platform: markers are evaluated for it, not for the machine running this script.
ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.11",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
HEADER = """\
# Pinned versions of infertap's runtime dependencies for image builds (Dockerfile:
# pip install -c constraints.txt .), the versions CI tests. Regenerate after changing
# pyproject.toml's dependencies: .venv/bin/python scripts/pin_constraints.py
"""


def pins() -> dict[str, str]:
    seen: dict[tuple[str, tuple[str, ...]], str] = {}

    def walk(spec: str, extras: tuple[str, ...] = ()) -> None:
        req = Requirement(spec)
        if req.marker and not any(req.marker.evaluate({**ENV, "extra": e}) for e in (extras or ("",))):
            return
        key = (re.sub(r"[-_.]+", "-", req.name).lower(), tuple(sorted(req.extras)))
        if key in seen:
            return
        dist = md.distribution(req.name)
        seen[key] = dist.version
        for sub in dist.requires or []:
            walk(sub, tuple(req.extras))

    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        walk(dep)
    return {name: version for (name, _), version in sorted(seen.items())}


def main() -> None:
    lines = [f"{name}=={version}\n" for name, version in pins().items()]
    (ROOT / "constraints.txt").write_text(HEADER + "".join(lines))
    print(f"constraints.txt: {len(lines)} pins")


if __name__ == "__main__":
    main()
