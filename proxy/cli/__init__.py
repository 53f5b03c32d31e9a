"""The `infertap` command: `infertap COMMAND --help` for each command's options."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from proxy import __version__

# name -> (module, one-line summary). Each module has `main(argv: list[str]) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("proxy.cli.serve", "run the proxy (on an embedded simulated engine when no upstream is set)"),
    "sim": ("proxy.sim.cli", "run the simulated OpenAI-compatible engine (prefill/decode/KV-cache model)"),
    "probe": ("proxy.tools.probe.cli", "stream requests to a base URL and report TTFT, TPOT and TPS"),
    "compare": ("proxy.tools.probe.compare", "A/B two targets: TTFT and TPOT side by side, with a verdict"),
    "engine-args": ("proxy.tools.engine_args", "turn an engine config.toml into vLLM/SGLang/LMDeploy flags"),
    "doctor": ("proxy.tools.doctor.cli", "diagnose the common prefill/decode faults from /metrics"),
    "bench": ("proxy.tools.bench.cli", "benchmark infertap's overhead against a direct connection"),
    "soak": ("proxy.tools.soak", "many concurrent streams with faults, checked byte for byte"),
}


def _available() -> dict[str, tuple[str, str]]:
    return {name: spec for name, spec in COMMANDS.items() if importlib.util.find_spec(spec[0]) is not None}


def usage() -> str:
    lines = [
        f"infertap {__version__}: an observability proxy for OpenAI-compatible LLM inference",
        "",
        "usage: infertap COMMAND [options]    (infertap COMMAND --help for a command's options)",
        "",
        "commands:",
    ]
    for name, (_, summary) in _available().items():
        lines.append(f"  {name:<12} {summary}")
    lines += [
        "",
        "Quick start: `infertap serve`, then point any OpenAI client at http://127.0.0.1:8080/v1",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"infertap {__version__}")
        return 0
    name, rest = args[0], args[1:]
    commands = _available()
    if name not in commands:
        print(f"infertap: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    entry: Callable[[list[str]], int] = importlib.import_module(commands[name][0]).main
    return entry(rest)
