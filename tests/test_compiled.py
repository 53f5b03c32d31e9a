"""The hot path's compiled modules (proxy/compiled/, scripts/compile.py): CI runs the suite on
them, an edited source is never shadowed by a stale build, and the classes mypyc cannot lay out
natively are marked so."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import compiled

ROOT = Path(__file__).resolve().parents[1]
built = any(compiled._built(name) for name in compiled.MODULES) and compiled.manifest_state() == "fresh"
needs_build = pytest.mark.skipif(not built, reason="no build of these sources: scripts/compile.py makes it")

# Bases a native class may have (mypyc's docs, "Native classes"), and the kinds of class mypyc
# compiles as plain Python classes by itself.
NATIVE_BASES = {"object", "Exception", "BaseException", "ValueError", "LookupError", "dict"}
# Python classes that add nothing to an instance's layout (empty __slots__ down to object: the test
# below holds them to it), which a native class may have as its base too.
EMPTY_BASES = {"asyncio.protocols.Protocol"}
ALLOWS_SUBCLASSES = {"mypyc_attr(allow_interpreted_subclasses=True)", "mypyc_attr(native_class=False)"}
OWN_KIND = {"Protocol", "NamedTuple", "StrEnum", "Enum", "IntEnum", "TypedDict"}
OWN_KIND |= {f"typing.{k}" for k in OWN_KIND} | {f"enum.{k}" for k in OWN_KIND}


def test_ci_runs_the_compiled_modules() -> None:
    """What users run by default is what CI tests: scripts/bootstrap compiles, and fails CI
    where it cannot."""
    if os.environ.get("CI") != "true" or os.environ.get("INFERTAP_NATIVE") == "0":
        pytest.skip("outside CI, the suite runs whichever build is there")
    assert compiled.state == compiled.COMPILED
    import proxy.core.sse

    assert not proxy.core.sse.__file__.endswith(".py")


def _states(package_root: Path, **env: str) -> tuple[str, list[str]]:
    code = (
        "import importlib, proxy, proxy.compiled as c; print(c.state); "
        "[print(importlib.import_module(m).__file__) for m in c.MODULES]"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(package_root), **env},
        cwd=package_root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return out[0], out[1:]


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "proxy", tmp_path / "proxy", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@needs_build
def test_a_build_that_matches_its_sources_runs_compiled(copy: Path) -> None:
    state, files = _states(copy)
    assert state == compiled.COMPILED
    assert len(files) == len(compiled.MODULES)
    assert not any(f.endswith(".py") for f in files)


@needs_build
def test_an_edited_source_makes_every_compiled_module_run_from_its_source(copy: Path) -> None:
    """One module edited: all run as Python (the build's modules call each other in C, so an edit
    of one would not reach the others' calls into it)."""
    edited = copy / "proxy" / "core" / "sse.py"
    edited.write_text(edited.read_text() + "\n# edited after the build\n")
    state, files = _states(copy)
    assert "stale" in state and "scripts/compile.py" in state
    assert files == [str(copy.joinpath(*m.split(".")).with_suffix(".py")) for m in compiled.MODULES]


@needs_build
def test_an_edited_module_that_is_not_compiled_makes_the_build_stale_too(copy: Path) -> None:
    """mypyc builds against the types and Final constants of the modules a compiled one imports
    (core/errors.py here): an edit of one of those is an edit of the build."""
    edited = copy / "proxy" / "core" / "errors.py"
    assert "proxy.core.errors" not in compiled.MODULES
    edited.write_text(edited.read_text() + "\n# edited after the build\n")
    state, files = _states(copy)
    assert "stale" in state
    assert all(f.endswith(".py") for f in files)


@needs_build
def test_native_0_runs_the_sources(copy: Path) -> None:
    state, files = _states(copy, INFERTAP_NATIVE="0")
    assert state == "python: INFERTAP_NATIVE=0"
    assert all(f.endswith(".py") for f in files)


def test_the_manifest_is_the_sources_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "MANIFEST", tmp_path / "manifest.json")
    assert compiled.manifest_state() == "absent"
    compiled.write_manifest()
    assert compiled.manifest_state() == "fresh"
    (tmp_path / "manifest.json").write_text('{"modules": {"proxy.core.sse": "0"}}')
    assert compiled.manifest_state() == "stale"


def _classes() -> list[tuple[str, ast.ClassDef]]:
    found = []
    for name in compiled.MODULES:
        tree = ast.parse(compiled.source(name).read_text())
        found += [(name, node) for node in tree.body if isinstance(node, ast.ClassDef)]
    return found


def _marks(node: ast.ClassDef) -> set[str]:
    return {ast.unparse(d) for d in node.decorator_list}


def test_a_compiled_class_with_a_base_that_is_not_compiled_is_a_plain_class() -> None:
    """A native class laid out over a Python base crashed the interpreter (logging's handler, in a
    first build: mypyc/mypyc#1200 is that class of bug); such a class is compiled as a plain
    Python class (its methods still compiled)."""
    plain = "mypyc_attr(native_class=False)"
    # A native class cannot have a plain one as its base either.
    own = {node.name for _, node in _classes() if plain not in _marks(node)}
    wrong = []
    for module, node in _classes():
        bases = {ast.unparse(b).split("[")[0] for b in node.bases}
        foreign = bases - own - NATIVE_BASES - EMPTY_BASES - OWN_KIND
        if foreign and plain not in _marks(node):
            wrong.append(f"{module}.{node.name}({', '.join(sorted(foreign))})")
    assert not wrong, "mark these @mypyc_attr(native_class=False): " + ", ".join(wrong)


def test_the_python_bases_a_native_class_may_have_add_nothing_to_its_layout() -> None:
    import asyncio.protocols

    assert EMPTY_BASES == {"asyncio.protocols.Protocol"}
    for cls in asyncio.protocols.Protocol.__mro__[:-1]:
        assert cls.__dict__.get("__slots__") == (), cls


def test_a_compiled_class_subclassed_elsewhere_allows_it() -> None:
    """A native class cannot have subclasses that are not compiled ("interpreted classes cannot
    inherit from compiled"), unless it says so."""
    compiled_classes = {node.name: (module, node) for module, node in _classes()}
    sources = {compiled.source(m) for m in compiled.MODULES}
    wrong = []
    for path in [*ROOT.joinpath("proxy").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]:
        if path in sources or "node_modules" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = ast.unparse(base).split("[")[0].rsplit(".", 1)[-1]
                if name not in compiled_classes:
                    continue
                module, parent = compiled_classes[name]
                marks = _marks(parent)
                if not marks & {
                    "mypyc_attr(allow_interpreted_subclasses=True)",
                    "mypyc_attr(native_class=False)",
                }:
                    wrong.append(f"{module}.{name} (subclassed in {path.relative_to(ROOT)})")
    assert not wrong, "mark these @mypyc_attr(allow_interpreted_subclasses=True): " + ", ".join(wrong)


def test_the_image_never_takes_the_hosts_build() -> None:
    """A build made on the host is for the host's Python: docker's context leaves it out."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "proxy/**/*.so" in ignore
    assert "proxy/compiled/manifest.json" in ignore
