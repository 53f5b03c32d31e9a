"""The hot path's compiled modules (proxy/compiled/, scripts/compile.py): CI runs the suite on
them, an edited source is never shadowed by a stale build, and the classes mypyc cannot lay out
natively are marked so."""

from __future__ import annotations

import ast
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import compiled
from proxy.core.exchange import Exchange
from proxy.core.forward.attempts import Call, Ready
from proxy.core.stream_facts import StreamFacts
from proxy.observe.tracing.record import SpanRecord
from proxy.observe.tracing.spans import _State

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
    (tmp_path / "manifest.json").write_text('{"sources": {"core/sse.py": "0"}}')
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
    first build); such a class is compiled as a plain Python class (its methods still compiled)."""
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
                if not marks & ALLOWS_SUBCLASSES:
                    wrong.append(f"{module}.{name} (subclassed in {path.relative_to(ROOT)})")
    assert not wrong, "mark these @mypyc_attr(allow_interpreted_subclasses=True): " + ", ".join(wrong)


def test_the_image_never_takes_the_hosts_build() -> None:
    """A build made on the host is for the host's Python: docker's context leaves it out."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "proxy/**/*.so" in ignore
    assert "proxy/compiled/manifest.json" in ignore


def _dataclasses_with_own_init() -> set[str]:
    found = set()
    for module, node in _classes():
        dataclass_ = any(ast.unparse(d).startswith("dataclass") for d in node.decorator_list)
        own_init = any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in node.body)
        if dataclass_ and own_init:
            found.add(f"{module}.{node.name}")
    return found


WRITTEN_INITS = {
    "proxy.core.exchange.Exchange": Exchange,
    "proxy.core.stream_facts.StreamFacts": StreamFacts,
    "proxy.core.forward.attempts.Call": Call,
    "proxy.core.forward.attempts.Ready": Ready,
    "proxy.observe.tracing.record.SpanRecord": SpanRecord,
    "proxy.observe.tracing.spans._State": _State,
}


def test_every_dataclass_whose_init_is_written_out_is_checked_here() -> None:
    assert _dataclasses_with_own_init() == set(WRITTEN_INITS)


@pytest.mark.parametrize("name", sorted(WRITTEN_INITS))
def test_a_written_out_init_sets_each_field_once_to_its_parameter_or_declared_default(name: str) -> None:
    """As read in the source: each field (in order) set once, to the parameter of its name (whose
    default is the field's) or to the field's default; a default_factory's value made anew."""
    module, _, cls_name = name.rpartition(".")
    tree = ast.parse(compiled.source(module).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    fields = [
        n for n in node.body if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n.annotation)
    ]
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = [*init.args.args[1:], *init.args.kwonlyargs]
    defaults = [None] * (len(init.args.args) - 1 - len(init.args.defaults)) + [*init.args.defaults]
    params = {
        a.arg: None if d is None else ast.unparse(d)
        for a, d in zip(args, [*defaults, *init.args.kw_defaults], strict=True)
    }
    sets = [
        (stmt.targets[0].attr, stmt.value)
        for stmt in init.body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute)
    ]
    assert [attr for attr, _ in sets] == [ast.unparse(f.target) for f in fields]
    for f, (attr, value) in zip(fields, sets, strict=True):
        declared = None if f.value is None else ast.unparse(f.value)
        factory = None
        if isinstance(f.value, ast.Call) and ast.unparse(f.value.func) == "field":
            factory = ast.unparse(f.value.keywords[0].value)
        made = ast.unparse(value)
        if factory is not None:
            call = {"dict": "{}", "list": "[]"}.get(factory, f"{factory}()")
            assert made in (call, f"{call} if {attr} is None else {attr}"), attr
            assert made == call or params[attr] == "None", attr
        elif made == attr:
            assert params[attr] == declared, attr
        else:
            assert attr not in params and made == declared, attr


@pytest.mark.parametrize("name", ["proxy.core.exchange.Exchange", "proxy.core.stream_facts.StreamFacts"])
def test_a_written_out_init_sets_every_field_to_its_declared_default(name: str) -> None:
    """The dataclass's fields stay the truth (repr, fields(), asdict, subclasses that are
    dataclasses): an __init__ written out for speed must set each one as the generated one would."""
    cls = WRITTEN_INITS[name]
    required = [
        f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING
    ]
    made = cls(*required)
    for f in dataclasses.fields(cls):
        value = getattr(made, f.name)  # unset: AttributeError
        if f.name in required:
            assert value == f.name, f.name
        elif f.default is not dataclasses.MISSING:
            assert value == f.default and type(value) is type(f.default), f.name
        else:
            factory = f.default_factory
            assert callable(factory)
            expected = factory()
            assert type(value) is type(expected), f.name
            if isinstance(expected, (dict, list)):
                assert value == expected, f.name
                assert value is not getattr(cls(*required), f.name), f"{f.name}: shared between records"


def test_the_written_out_inits_take_their_keywords() -> None:
    ex = Exchange(
        "r", "chat.completions", "POST", "/v1/x", received_at=1.5, started_unix_ns=7, model="m", upstream="u"
    )
    assert (ex.received_at, ex.started_unix_ns, ex.model, ex.upstream) == (1.5, 7, "m", "u")
    assert StreamFacts(capture_chars=5).capture_chars == 5
