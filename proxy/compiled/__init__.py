"""The hot path's modules, compiled with mypyc where scripts/compile.py built them, and the guard
that keeps a compiled module from running in place of a source that changed since.

A compiled module sits beside its source (`sse.cpython-311-*.so` by `sse.py`) and Python's import
prefers it. The modules of one build also call each other directly, in C, and were built against
the types of the modules they import, so a build is used whole or not at all: when any source of
the package differs from the hash that the build's manifest recorded (an edit, a checkout of
another commit), or when INFERTAP_NATIVE=0, every compiled module is imported from its source
instead. This module is never compiled, and `proxy/__init__` installs the guard before anything
else of the package is imported. The build's manifest is `manifest.json` here.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parent.parent
MANIFEST = Path(__file__).resolve().with_name("manifest.json")
# The shared library that holds the build's code (mypyc's group), beside the package's modules.
GROUP = "proxy.native"

# The request's and the stream's way through infertap (docs/architecture.md): the raw cycle,
# dispatch, the forwarder, the httptools client, the SSE scanner and the per-request observers.
# Not here: the edge (edge.py, raw_routes.py: compiled, it counted no fewer instructions, and
# tests/test_edge.py reads its methods' signatures, which a compiled method has none of; a
# connection's reads and llhttp's callbacks go to request_head.py's native class instead); whatever
# runs once (settings, the app). mypyc compiles no async generator: these modules' async iterators
# are classes.
MODULES = (
    "proxy.control.dispatch",
    "proxy.core.asgi",
    "proxy.core.circuit",
    "proxy.core.exchange",
    "proxy.core.forward.attempts",
    "proxy.core.forward.early",
    "proxy.core.forward.forwarder",
    "proxy.core.forward.intake",
    "proxy.core.forward.lifetime",
    "proxy.core.forward.relay",
    "proxy.core.headers",
    "proxy.core.hooks",
    "proxy.core.model_routing",
    "proxy.core.observer",
    "proxy.core.request_ids",
    "proxy.core.route_table",
    "proxy.core.sse",
    "proxy.core.stream_facts",
    "proxy.observe.access_log",
    "proxy.observe.log_lines",
    "proxy.observe.metrics.fast",
    "proxy.observe.metrics.labels",
    "proxy.observe.metrics.prometheus",
    "proxy.observe.tracing.record",
    "proxy.observe.tracing.spans",
    "proxy.observe.ui.observer",
    "proxy.observe.upstream_stats",
    "proxy.server.raw_cycle",
    "proxy.server.request_head",
    "proxy.transport.h1_client",
    "proxy.transport.h1_connection",
    "proxy.transport.h1_headers",
    "proxy.transport.h1_response",
    "proxy.transport.slots",
)


def source(name: str) -> Path:
    return PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")


def _hashes() -> dict[str, str]:
    # Every source of the package, not only the compiled ones: mypyc builds against the types (and
    # inlines the Final constants) of the modules a compiled one imports, so an edit of those makes
    # the build as stale as an edit of its own.
    return {
        path.relative_to(PACKAGE).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def write_manifest() -> None:
    MANIFEST.write_text(json.dumps({"sources": _hashes()}, indent=1, sort_keys=True) + "\n")


def manifest_state() -> str:
    """The build against the package's sources: "fresh" (it matches every one), "stale" or "absent"."""
    try:
        recorded = json.loads(MANIFEST.read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return "absent"
    return "fresh" if recorded == _hashes() else "stale"


def _built(name: str) -> bool:
    path = source(name)
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return any(path.with_name(path.stem + suffix).exists() for suffix in suffixes)


class _Sources(importlib.abc.MetaPathFinder):
    """Imports the build's modules from their sources, ahead of the compiled files beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, source(fullname))


COMPILED = "compiled (mypyc)"
# What this process runs, for the startup log and `infertap bench`'s machine line: set by install().
state = "python"


def install() -> str:
    """Called once, by proxy/__init__: COMPILED, or why the sources run instead."""
    global state
    if not any(_built(name) for name in MODULES):
        state = "python: no compiled modules (scripts/compile.py builds them)"
        return state
    if os.environ.get("INFERTAP_NATIVE", "1") == "0":
        state = "python: INFERTAP_NATIVE=0"
    else:
        found = manifest_state()
        state = (
            COMPILED
            if found == "fresh"
            else f"python: the compiled modules are {found} (rebuild: .venv/bin/python scripts/compile.py)"
        )
    if state != COMPILED and not any(isinstance(f, _Sources) for f in sys.meta_path):
        sys.meta_path.insert(0, _Sources())
    return state
