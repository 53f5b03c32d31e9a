"""`infertap engine-args` on the seed's config.toml, for vLLM, SGLang and LMDeploy."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from proxy.sim.config import load_sim_config
from proxy.tools import engine_args

ROOT = Path(__file__).resolve().parent.parent
SEED_CONFIG = ROOT / "examples" / "engine-config.toml"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = engine_args.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def plan(
    capsys: pytest.CaptureFixture[str], engine: str, *extra: str, config: Path = SEED_CONFIG
) -> dict[str, Any]:
    code, out, err = run(capsys, "--engine", engine, "--format", "json", *extra, str(config))
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    assert set(data) == {"argv", "request_defaults", "warnings"}
    # Every warning also went to stderr, one line each.
    assert [ln.removeprefix("warning: ") for ln in err.splitlines()] == data["warnings"]
    return data


def flag(argv: list[str], name: str) -> str:
    """The value after `name`; fails when the flag is missing or repeated."""
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def has_pair(argv: list[str], name: str, value: str) -> bool:
    return any(a == name and b == value for a, b in zip(argv, argv[1:], strict=False))


SEED_DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 50,
    "repetition_penalty": 1.05,
    "max_tokens": 1024,
}


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def seed_with(tmp_path: Path, old: str, new: str) -> Path:
    text = SEED_CONFIG.read_text()
    assert old in text
    return write(tmp_path, text.replace(old, new))


# -- the seed's config, three engines ----------------------------------------------------------


def test_vllm_flags_for_the_seed_config(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(capsys, "vllm")
    argv = p["argv"]
    assert argv[:3] == ["vllm", "serve", "your-model-name"]
    for name, value in [
        ("--block-size", "16"),
        ("--max-num-seqs", "64"),
        ("--max-num-batched-tokens", "4096"),
        ("--gpu-memory-utilization", "0.9"),
        ("--max-model-len", "8192"),
        ("--dtype", "bfloat16"),
        ("--host", "0.0.0.0"),
        ("--port", "8000"),
        ("--kv-cache-dtype", "auto"),
        ("--num-gpu-blocks-override", "2048"),
    ]:
        assert flag(argv, name) == value, name
    assert argv.count("--enable-chunked-prefill") == 1
    assert "--no-enable-chunked-prefill" not in argv and "--no-enable-prefix-caching" not in argv
    assert "--swap-space" not in argv  # removed in vLLM 0.18 (and ignored by V1 before that)
    gen = json.loads(flag(argv, "--override-generation-config"))
    assert gen == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "repetition_penalty": 1.05,
        "max_new_tokens": 1024,
    }
    assert p["request_defaults"] == SEED_DEFAULTS
    assert any(w.startswith("kv_cache.swap_space_gb=8") for w in p["warnings"])
    assert any(w.startswith("prefill.max_prefill_tokens=2048") for w in p["warnings"])
    assert not any(w.startswith("decode.") for w in p["warnings"])  # all five have a vLLM home


def test_sglang_flags_for_the_seed_config(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(capsys, "sglang")
    argv = p["argv"]
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    for name, value in [
        ("--model-path", "your-model-name"),
        ("--page-size", "16"),
        ("--host", "0.0.0.0"),
        ("--port", "8000"),
        ("--dtype", "bfloat16"),
        ("--context-length", "8192"),
        ("--mem-fraction-static", "0.9"),
        ("--max-running-requests", "64"),
        ("--max-prefill-tokens", "4096"),
        ("--chunked-prefill-size", "2048"),
        ("--max-total-tokens", str(2048 * 16)),
        ("--kv-cache-dtype", "auto"),
    ]:
        assert flag(argv, name) == value, name
    assert "--disable-radix-cache" not in argv
    assert p["request_defaults"] == SEED_DEFAULTS
    for key in SEED_DEFAULTS:  # one warning per sampling field SGLang has no flag for
        assert sum(w.startswith(f"decode.{key}=") for w in p["warnings"]) == 1, key


def test_lmdeploy_flags_for_the_seed_config(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(capsys, "lmdeploy")
    argv = p["argv"]
    assert argv[:4] == ["lmdeploy", "serve", "api_server", "your-model-name"]
    for name, value in [
        ("--server-name", "0.0.0.0"),
        ("--server-port", "8000"),
        ("--dtype", "bfloat16"),
        ("--session-len", "8192"),
        ("--cache-max-entry-count", "0.9"),
        ("--cache-block-seq-len", "16"),
        ("--max-batch-size", "64"),
        ("--max-prefill-token-num", "4096"),
        ("--quant-policy", "0"),
    ]:
        assert flag(argv, name) == value, name
    warnings = p["warnings"]
    assert any(w.startswith("kv_cache.block_size=16") and "TurboMind" in w for w in warnings)
    for prefix in ("kv_cache.num_gpu_blocks=", "kv_cache.swap_space_gb=", "prefill.chunked_prefill"):
        assert any(w.startswith(prefix) for w in warnings), prefix
    for key in SEED_DEFAULTS:
        assert sum(w.startswith(f"decode.{key}=") for w in warnings) == 1, key


def test_vllm_is_the_default_engine_and_shell_is_the_default_format(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, str(SEED_CONFIG))
    assert code == 0
    assert out.startswith("vllm serve your-model-name \\\n")
    assert "warning: kv_cache.swap_space_gb=8" in err


@pytest.mark.parametrize("engine", engine_args.ENGINES)
def test_shell_output_is_a_runnable_command(capsys: pytest.CaptureFixture[str], engine: str) -> None:
    argv = plan(capsys, engine)["argv"]
    code, out, _ = run(capsys, "--engine", engine, str(SEED_CONFIG))
    assert code == 0
    # What a POSIX shell would run: backslash-newline continues the line; the rest is shlex-quoted.
    command = "\n".join(ln for ln in out.splitlines() if not ln.startswith("#")).replace("\\\n", "")
    assert shlex.split(command) == argv
    comments = [ln for ln in out.splitlines() if ln.startswith("#")]
    assert json.loads(comments[-1].removeprefix("# ")) == SEED_DEFAULTS


def test_the_sim_reads_the_same_file() -> None:
    cfg = load_sim_config(SEED_CONFIG)
    assert cfg.kv_cache.block_size == 16 and cfg.batching.max_num_seqs == 64 and cfg.decode.max_tokens == 1024


# -- switches ----------------------------------------------------------------------------------


def test_kv_cache_off_has_no_engine_flag_and_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = seed_with(tmp_path, "enable = true", "enable = false")
    for engine in engine_args.ENGINES:
        p = plan(capsys, engine, config=config)
        warning = next(w for w in p["warnings"] if w.startswith("kv_cache.enable=false"))
        assert "no flag" in warning
        assert not any("kv" in a and "enable" in a for a in p["argv"])


def test_chunked_prefill_off(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = seed_with(tmp_path, "chunked_prefill = true", "chunked_prefill = false")
    vllm = plan(capsys, "vllm", config=config)["argv"]
    assert "--no-enable-chunked-prefill" in vllm and "--enable-chunked-prefill" not in vllm
    assert flag(plan(capsys, "sglang", config=config)["argv"], "--chunked-prefill-size") == "-1"


def test_no_prefix_caching(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--no-enable-prefix-caching" in plan(capsys, "vllm", "--no-prefix-caching")["argv"]
    assert "--disable-radix-cache" in plan(capsys, "sglang", "--no-prefix-caching")["argv"]
    assert not any("prefix" in a for a in plan(capsys, "lmdeploy", "--no-prefix-caching")["argv"])


def test_continuous_batching_off_warns(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = seed_with(tmp_path, "enable_continuous_batching = true", "enable_continuous_batching = false")
    p = plan(capsys, "sglang", config=config)
    assert any(w.startswith("batching.enable_continuous_batching=false") for w in p["warnings"])


def test_kv_cache_dtype_for_lmdeploy(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = seed_with(tmp_path, 'cache_dtype = "auto"', 'cache_dtype = "int8"')
    assert flag(plan(capsys, "lmdeploy", config=config)["argv"], "--quant-policy") == "8"
    config = seed_with(tmp_path, 'cache_dtype = "auto"', 'cache_dtype = "fp8_e5m2"')
    p = plan(capsys, "lmdeploy", config=config)
    assert "--quant-policy" not in p["argv"]
    assert any(w.startswith("kv_cache.cache_dtype='fp8_e5m2'") for w in p["warnings"])
    assert flag(plan(capsys, "vllm", config=config)["argv"], "--kv-cache-dtype") == "fp8_e5m2"


def test_a_minimal_config_uses_the_seed_defaults(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write(tmp_path, '[model]\nname = "Qwen/Qwen2.5-0.5B-Instruct"\n')
    argv = plan(capsys, "vllm", config=config)["argv"]
    assert argv[2] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert has_pair(argv, "--block-size", "16") and has_pair(argv, "--max-num-seqs", "64")


# -- errors: a clear message naming the field, exit 2 ------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[kv_cache]\nblock_size = 16\n", "model.name: required"),
        ('[model]\nname = "m"\n[kv_cache]\nblock_size = 0\n', "kv_cache.block_size"),
        ('[model]\nname = "m"\n[batching]\nmax_num_seq = 64\n', "batching.max_num_seq: unknown key"),
        ('[model]\nname = "m"\ndtype = \n', "not valid TOML"),
        ('[model]\nname = "m"\n[kv_cache]\nnum_gpu_blocks = 16\n', "kv_cache.num_gpu_blocks"),
    ],
)
def test_bad_config_names_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str
) -> None:
    config = write(tmp_path, text)
    code, out, err = run(capsys, str(config))
    assert code == 2 and out == ""
    assert message in err and str(config) in err


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, str(tmp_path / "nope.toml"))
    assert code == 2 and "config file not found" in err


def test_usage_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys)[0] == 2  # the config path is required
    code, _, err = run(capsys, "--engine", "tgi", str(SEED_CONFIG))
    assert code == 2 and "invalid choice" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "examples:" in out and "--engine" in out and "docs/engine-args.md" in out
