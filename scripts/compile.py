"""Compiles infertap's hot-path modules (the list in proxy/compiled/) to C extensions with mypyc,
in place, beside their sources, and writes the manifest that proxy/compiled/ checks at import:
each module's source hash. A checkout whose sources changed since runs them as Python until this
runs again, so an edit never runs stale compiled code (docs/architecture.md, "Compiled modules").

  .venv/bin/python scripts/compile.py           build when the build is missing or stale
  .venv/bin/python scripts/compile.py --force   build even when it is fresh
  .venv/bin/python scripts/compile.py --clean   remove the build (the sources run)

Needs mypy (mypyc comes with it), setuptools and a C compiler with Python's headers (Debian: gcc,
python3-dev); scripts/bootstrap installs the first two (infertap[native]), runs this, and where it
fails goes on with the sources (but in CI).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy import compiled  # noqa: E402


def clean() -> None:
    for path in (ROOT / "proxy").rglob("*.so"):
        path.unlink()
    compiled.MANIFEST.unlink(missing_ok=True)


def build() -> None:
    from mypyc.build import mypycify
    from setuptools import Distribution

    clean()
    sources = [str(compiled.source(name).relative_to(ROOT)) for name in compiled.MODULES]
    started = time.monotonic()
    print(f"==> compiling {len(sources)} modules with mypyc (a minute or two)", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix="infertap-mypyc-"))
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)  # mypyc names modules by their paths from here
        extensions = mypycify(
            [*sources, "--config-file", str(ROOT / "pyproject.toml")],
            opt_level="3",
            group_name=compiled.GROUP,
            target_dir=str(work / "c"),
        )
        # A bare Distribution: setup() would read pyproject.toml, whose metadata is hatchling's.
        dist = Distribution({"name": "infertap-compiled", "ext_modules": extensions})
        dist.script_args = [
            "-q",
            "build_ext",
            "--inplace",
            "--build-temp",
            str(work / "tmp"),
            "--build-lib",
            str(work / "lib"),
        ]
        dist.parse_command_line()
        dist.run_commands()
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    compiled.write_manifest()
    took = time.monotonic() - started
    print(f"==> compiled {len(sources)} modules in {took:.0f} s", file=sys.stderr, flush=True)


def main() -> None:
    args = sys.argv[1:]
    if args not in ([], ["--force"], ["--clean"]):
        sys.exit(__doc__)
    if args == [] and compiled.manifest_state() == "fresh":
        return
    # One build at a time (scripts/serve and scripts/test started together): the second waits,
    # then finds the first's build fresh.
    with open(compiled.MANIFEST.with_name("build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if args == ["--clean"]:
            clean()
        elif args == ["--force"] or compiled.manifest_state() != "fresh":
            build()


if __name__ == "__main__":
    main()
