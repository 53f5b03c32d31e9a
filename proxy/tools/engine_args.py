"""`infertap engine-args`: turn the seed's engine config.toml into a vLLM, SGLang or LMDeploy launch command.

The file is read with the simulated engine's schema (`proxy.sim.config`), so the very same
config.toml drives `infertap sim` and a real engine. Each generic field maps to one engine flag
where the engine has one (see docs/engine-args.md); a field the engine has no flag for gives a
warning on stderr instead of a made-up flag. The [decode] section holds per-request sampling
defaults: vLLM takes them through `--override-generation-config`; for the others they are
printed as the JSON to send with each request.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.sim.config import SimConfig, SimConfigError, sim_config_from_dict

ENGINES = ("vllm", "sglang", "lmdeploy")

# Values each engine's --dtype / --kv-cache-dtype accept (from their CLI docs); anything else
# is passed through with a warning rather than refused: engines add choices over time.
_DTYPES = {
    "vllm": {"auto", "half", "float16", "bfloat16", "float", "float32"},
    "sglang": {"auto", "half", "float16", "bfloat16", "float", "float32"},
    "lmdeploy": {"auto", "float16", "bfloat16"},
}
_KV_DTYPES = {
    "vllm": {"auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"},
    "sglang": {"auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"},
}
# LMDeploy quantises the KV cache through --quant-policy: 0 none, 8 int8, 4 int4.
_LMDEPLOY_QUANT_POLICY = {"auto": 0, "bfloat16": 0, "bf16": 0, "float16": 0, "int8": 8, "int4": 4}

_DECODE_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")


class EngineArgsError(Exception):
    """A config that cannot be turned into flags; the message names the file and field."""


@dataclass
class LaunchPlan:
    argv: list[str]
    request_defaults: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"argv": self.argv, "request_defaults": self.request_defaults, "warnings": self.warnings}


def load_engine_config(path: str | Path) -> SimConfig:
    """Read and validate an engine config.toml; `[model] name` is required (the engine loads it)."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise EngineArgsError(f"{p}: config file not found") from None
    except OSError as e:
        raise EngineArgsError(f"{p}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise EngineArgsError(f"{p}: not valid TOML: {e}") from None
    model = data.get("model")
    if not isinstance(model, dict) or "name" not in model:
        raise EngineArgsError(
            f"{p}: model.name: required (the model path or Hugging Face id the engine should load)"
        )
    try:
        return sim_config_from_dict(data)
    except SimConfigError as e:
        raise EngineArgsError(f"{p}: {e}") from None


def _request_defaults(cfg: SimConfig) -> dict[str, Any]:
    return {name: getattr(cfg.decode, name) for name in _DECODE_FIELDS}


def _check_dtypes(engine: str, cfg: SimConfig, warn: Callable[[str], None]) -> None:
    if cfg.model.dtype not in _DTYPES[engine]:
        warn(f"model.dtype={cfg.model.dtype!r} is not a documented {engine} --dtype choice")
    kv = cfg.kv_cache.cache_dtype
    if engine in _KV_DTYPES and kv not in _KV_DTYPES[engine]:
        warn(f"kv_cache.cache_dtype={kv!r} is not a documented {engine} --kv-cache-dtype choice")


def _common_warnings(engine: str, cfg: SimConfig, warn: Callable[[str], None]) -> None:
    name = {"vllm": "vLLM", "sglang": "SGLang", "lmdeploy": "LMDeploy"}[engine]
    if cfg.model.name == "your-model-name":
        warn("model.name is the seed's placeholder: set it to a model path or Hugging Face id")
    if not cfg.kv_cache.enable:
        warn(
            f"kv_cache.enable=false: {name} has no flag to run without a KV cache (paged KV is how it "
            "decodes); to compare cache effects, turn prefix caching off with --no-prefix-caching, "
            "or run the A/B on `infertap sim`"
        )
    if not cfg.batching.enable_continuous_batching:
        warn(
            f"batching.enable_continuous_batching=false: {name} always batches continuously and has "
            "no flag to turn it off (max_num_seqs=1 serialises requests, if that is the intent)"
        )


def vllm_plan(cfg: SimConfig, *, prefix_caching_off: bool = False) -> LaunchPlan:
    m, kv, b, pf = cfg.model, cfg.kv_cache, cfg.batching, cfg.prefill
    plan = LaunchPlan(["vllm", "serve", m.name], _request_defaults(cfg))
    warn = plan.warnings.append
    plan.argv += ["--host", cfg.server.host, "--port", str(cfg.server.port)]
    plan.argv += ["--dtype", m.dtype, "--max-model-len", str(m.max_model_len)]
    plan.argv += ["--gpu-memory-utilization", _num(m.gpu_memory_utilization)]
    plan.argv += ["--block-size", str(kv.block_size), "--num-gpu-blocks-override", str(kv.num_gpu_blocks)]
    plan.argv += ["--kv-cache-dtype", kv.cache_dtype]
    plan.argv += [
        "--max-num-seqs",
        str(b.max_num_seqs),
        "--max-num-batched-tokens",
        str(b.max_num_batched_tokens),
    ]
    plan.argv.append("--enable-chunked-prefill" if pf.chunked_prefill else "--no-enable-chunked-prefill")
    if prefix_caching_off:
        plan.argv.append("--no-enable-prefix-caching")
    gen = {k: v for k, v in plan.request_defaults.items() if k != "max_tokens"}
    gen["max_new_tokens"] = plan.request_defaults["max_tokens"]  # vLLM reads HF's name, as max_tokens
    plan.argv += ["--override-generation-config", json.dumps(gen, separators=(",", ":"))]
    _check_dtypes("vllm", cfg, warn)
    if kv.block_size > 32:
        warn(
            f"kv_cache.block_size={kv.block_size}: vLLM's CUDA attention backends document block "
            "sizes up to 32"
        )
    warn(
        f"kv_cache.swap_space_gb={_num(kv.swap_space_gb)}: not passed: vLLM's V1 engine preempts by "
        "recomputation and ignores --swap-space, and vLLM 0.18 removed the flag"
    )
    warn(
        f"prefill.max_prefill_tokens={pf.max_prefill_tokens}: vLLM has no separate cap; a prefill "
        f"chunk is bounded by --max-num-batched-tokens ({b.max_num_batched_tokens})"
    )
    _common_warnings("vllm", cfg, warn)
    return plan


def sglang_plan(cfg: SimConfig, *, prefix_caching_off: bool = False) -> LaunchPlan:
    m, kv, b, pf = cfg.model, cfg.kv_cache, cfg.batching, cfg.prefill
    plan = LaunchPlan(
        ["python", "-m", "sglang.launch_server", "--model-path", m.name], _request_defaults(cfg)
    )
    warn = plan.warnings.append
    plan.argv += ["--host", cfg.server.host, "--port", str(cfg.server.port)]
    plan.argv += ["--dtype", m.dtype, "--context-length", str(m.max_model_len)]
    plan.argv += ["--mem-fraction-static", _num(m.gpu_memory_utilization)]
    plan.argv += [
        "--page-size",
        str(kv.block_size),
        "--max-total-tokens",
        str(kv.num_gpu_blocks * kv.block_size),
    ]
    plan.argv += ["--kv-cache-dtype", kv.cache_dtype]
    plan.argv += ["--max-running-requests", str(b.max_num_seqs)]
    plan.argv += ["--max-prefill-tokens", str(b.max_num_batched_tokens)]
    plan.argv += ["--chunked-prefill-size", str(pf.max_prefill_tokens) if pf.chunked_prefill else "-1"]
    if prefix_caching_off:
        plan.argv.append("--disable-radix-cache")
    _check_dtypes("sglang", cfg, warn)
    warn(
        f"kv_cache.swap_space_gb={_num(kv.swap_space_gb)}: SGLang has no KV swap space (its hierarchical "
        "cache, --enable-hierarchical-cache, is a different feature)"
    )
    _common_warnings("sglang", cfg, warn)
    _no_sampling_flags("SGLang", plan, "--sampling-defaults only chooses between the model's and OpenAI's")
    return plan


def lmdeploy_plan(cfg: SimConfig, *, prefix_caching_off: bool = False) -> LaunchPlan:
    m, kv, b, pf = cfg.model, cfg.kv_cache, cfg.batching, cfg.prefill
    plan = LaunchPlan(["lmdeploy", "serve", "api_server", m.name], _request_defaults(cfg))
    warn = plan.warnings.append
    plan.argv += ["--server-name", cfg.server.host, "--server-port", str(cfg.server.port)]
    plan.argv += ["--dtype", m.dtype, "--session-len", str(m.max_model_len)]
    plan.argv += ["--cache-max-entry-count", _num(m.gpu_memory_utilization)]
    plan.argv += ["--cache-block-seq-len", str(kv.block_size)]
    plan.argv += [
        "--max-batch-size",
        str(b.max_num_seqs),
        "--max-prefill-token-num",
        str(b.max_num_batched_tokens),
    ]
    policy = _LMDEPLOY_QUANT_POLICY.get(kv.cache_dtype)
    if policy is None:
        warn(
            f"kv_cache.cache_dtype={kv.cache_dtype!r}: LMDeploy quantises the KV cache only to int8 or "
            "int4 (--quant-policy 8 or 4); not passed"
        )
    else:
        plan.argv += ["--quant-policy", str(policy)]
    # prefix caching is off by default in LMDeploy (--enable-prefix-caching turns it on).
    del prefix_caching_off
    _check_dtypes("lmdeploy", cfg, warn)
    if kv.block_size % 32:
        warn(
            f"kv_cache.block_size={kv.block_size}: LMDeploy's TurboMind backend needs a multiple of 32 "
            "(GPU compute capability >= 8.0) or of 64 (older GPUs); use 64, or add --backend pytorch"
        )
    warn(
        f"model.gpu_memory_utilization={_num(m.gpu_memory_utilization)} became --cache-max-entry-count: in "
        "LMDeploy that is the share of the memory left free after the weights that the KV cache takes"
    )
    warn(
        f"kv_cache.num_gpu_blocks={kv.num_gpu_blocks}: LMDeploy's api_server has no flag for the block count"
    )
    warn(f"kv_cache.swap_space_gb={_num(kv.swap_space_gb)}: LMDeploy's api_server has no swap-space flag")
    warn(
        f"prefill.chunked_prefill/max_prefill_tokens={pf.max_prefill_tokens}: LMDeploy has no flags for "
        f"these; it splits prefill by --max-prefill-token-num ({b.max_num_batched_tokens})"
    )
    _common_warnings("lmdeploy", cfg, warn)
    _no_sampling_flags("LMDeploy", plan, "its api_server takes sampling parameters per request")
    return plan


def _no_sampling_flags(name: str, plan: LaunchPlan, why: str) -> None:
    for key in _DECODE_FIELDS:
        plan.warnings.append(
            f"decode.{key}={_num(plan.request_defaults[key])}: {name} has no server flag for a default "
            f"{key} ({why}); send it with each request (see the request defaults)"
        )


def _num(v: Any) -> str:
    """TOML 0.90 -> "0.9", 8.0 -> "8": the shortest exact spelling."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


PLANNERS: dict[str, Callable[..., LaunchPlan]] = {
    "vllm": vllm_plan,
    "sglang": sglang_plan,
    "lmdeploy": lmdeploy_plan,
}


def plan_for(engine: str, cfg: SimConfig, *, prefix_caching_off: bool = False) -> LaunchPlan:
    return PLANNERS[engine](cfg, prefix_caching_off=prefix_caching_off)


def format_shell(plan: LaunchPlan) -> str:
    """The command, one flag per line with backslashes; request defaults as trailing # comments."""
    words = [shlex.quote(w) for w in plan.argv]
    lines: list[str] = []
    head_len = next((n for n, w in enumerate(plan.argv) if w.startswith("--")), len(plan.argv))
    lines.append(" ".join(words[:head_len]))
    i = head_len
    while i < len(words):
        flag = words[i]
        if i + 1 < len(words) and not plan.argv[i + 1].startswith("--"):
            lines.append(f"  {flag} {words[i + 1]}")
            i += 2
        else:
            lines.append(f"  {flag}")
            i += 1
    out = " \\\n".join(lines)
    defaults = json.dumps(plan.request_defaults, separators=(", ", ": "))
    out += (
        "\n# Request defaults from [decode]; send them in each chat-completions body "
        "(top_k and repetition_penalty are engine extensions: with the OpenAI SDK, pass them in extra_body):"
        f"\n# {defaults}"
    )
    return out


_EPILOG = """\
examples:
  infertap engine-args examples/engine-config.toml
  infertap engine-args --engine sglang examples/engine-config.toml
  infertap engine-args --engine lmdeploy --format json examples/engine-config.toml | jq .argv

The command goes to stdout (a shell script: the request defaults follow as # comments);
warnings about fields the engine has no flag for go to stderr. Field-by-field mapping:
docs/engine-args.md. Exit status: 0 ok, 2 bad or missing config.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infertap engine-args",
        description="Print the vLLM / SGLang / LMDeploy launch command for an engine config.toml "
        "(the seed's [model] [kv_cache] [batching] [prefill] [decode] [server] skeleton).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="the engine config.toml (e.g. examples/engine-config.toml)")
    parser.add_argument("--engine", choices=ENGINES, default="vllm", help="target engine (default: vllm)")
    parser.add_argument(
        "--format",
        choices=("shell", "json"),
        default="shell",
        help='shell: a runnable command; json: {"argv", "request_defaults", "warnings"} (default: shell)',
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="also turn the engine's prefix caching off (vLLM --no-enable-prefix-caching, SGLang "
        "--disable-radix-cache; LMDeploy has it off by default), e.g. for a clean KV-cache A/B",
    )
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2): return, do not raise
        return int(e.code or 0)
    try:
        cfg = load_engine_config(args.config)
    except EngineArgsError as e:
        print(f"infertap engine-args: {e}", file=sys.stderr)
        return 2
    plan = plan_for(args.engine, cfg, prefix_caching_off=args.no_prefix_caching)
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(plan.as_json(), indent=2))
    else:
        print(format_shell(plan))
    return 0
