"""The simulated engine's configuration: the seed's engine-side config.toml plus a [sim] section.

The sections and defaults are the seed article's skeleton. `[server]` is accepted so the very
same file can be handed to a real engine (see `infertap engine-args`) and to the sim; the sim
ignores it (its address comes from the command line).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SimConfigError(ValueError):
    """A config file that cannot be read or holds a bad value; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    name: str = Field(default="sim-model", min_length=1, description="served model name")
    dtype: str = "bfloat16"
    max_model_len: int = Field(default=8192, gt=0, description="prompt + completion limit, in tokens")
    gpu_memory_utilization: float = Field(default=0.90, gt=0, le=1)


class KVCacheSection(_Section):
    enable: bool = True
    block_size: int = Field(default=16, gt=0, le=1024)
    num_gpu_blocks: int = Field(default=2048, gt=0)
    swap_space_gb: float = Field(default=8, ge=0)
    cache_dtype: str = "auto"


class BatchingSection(_Section):
    enable_continuous_batching: bool = True
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=4096, gt=0, description="token budget of one step")


class PrefillSection(_Section):
    chunked_prefill: bool = True
    max_prefill_tokens: int = Field(default=2048, gt=0, description="prefill tokens in one step")


class DecodeSection(_Section):
    """Defaults for requests that do not set these themselves."""

    temperature: float = Field(default=0.7, ge=0, le=2)
    top_p: float = Field(default=0.9, gt=0, le=1)
    top_k: int = Field(default=50, ge=-1, description="-1 or 0: disabled")
    repetition_penalty: float = Field(default=1.05, gt=0, le=2)
    max_tokens: int = Field(default=1024, gt=0)


class ServerSection(_Section):
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    api_base: str | None = None
    api_key_env: str | None = None


class SimSection(_Section):
    """Timing constants, in milliseconds. The defaults feel like a small model on one GPU.

    A step is one forward pass over the batch. It costs the decode part when it decodes and the
    prefill part when it prefills (a chunked-prefill step does both):
      decode:  decode_step_ms + decode_ms_per_running_seq * decoding sequences
               (+ no_kv_cache_ms_per_context_token * their summed context when the KV cache is off)
      prefill: prefill_base_ms + prefill_ms_per_token * prefilled tokens
    """

    prefill_base_ms: float = Field(default=15.0, ge=0)
    prefill_ms_per_token: float = Field(default=0.05, ge=0)
    decode_step_ms: float = Field(default=20.0, ge=0)
    decode_ms_per_running_seq: float = Field(default=0.3, ge=0)
    # Without a KV cache every step recomputes the whole history, which is a prefill of the
    # context: hence the same per-token price as prefill by default.
    no_kv_cache_ms_per_context_token: float = Field(default=0.05, ge=0)
    seed: int = 0
    default_output_tokens: int = Field(default=128, ge=0, description="length a request ends at by itself")
    # Fixed timings for every request (like the x-sim-ttft-ms / x-sim-tpot-ms headers): such a
    # request skips the scheduler, so load does not change it.
    fixed_ttft_ms: float | None = Field(default=None, ge=0)
    fixed_tpot_ms: float | None = Field(default=None, ge=0)
    embedding_dim: int = Field(default=384, gt=0, le=8192)
    # Names served besides [model] name (vLLM's --served-model-name takes several too).
    served_model_names: list[str] = Field(default_factory=list)
    # Answer any model name (echoed back) instead of 404 model_not_found.
    accept_any_model: bool = False


class SimConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    kv_cache: KVCacheSection = Field(default_factory=KVCacheSection)
    batching: BatchingSection = Field(default_factory=BatchingSection)
    prefill: PrefillSection = Field(default_factory=PrefillSection)
    decode: DecodeSection = Field(default_factory=DecodeSection)
    server: ServerSection = Field(default_factory=ServerSection)
    sim: SimSection = Field(default_factory=SimSection)

    @model_validator(mode="after")
    def _one_sequence_fits(self) -> Self:
        # As vLLM refuses to start: a sequence of max_model_len must fit the KV cache, otherwise a
        # lone request could wait for blocks forever.
        kv = self.kv_cache
        capacity = kv.num_gpu_blocks * kv.block_size
        if kv.enable and capacity < self.model.max_model_len:
            raise ValueError(
                f"kv_cache.num_gpu_blocks: {kv.num_gpu_blocks} blocks of {kv.block_size} tokens hold "
                f"{capacity} tokens, fewer than one sequence of model.max_model_len="
                f"{self.model.max_model_len}; raise num_gpu_blocks or lower max_model_len"
            )
        return self


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg} (got {e.get('input')!r})" if e["loc"] else msg)
    return "; ".join(lines)


def sim_config_from_dict(data: dict[str, Any]) -> SimConfig:
    try:
        return SimConfig.model_validate(data)
    except ValidationError as e:
        raise SimConfigError(_describe(e)) from None


def load_sim_config(path: str | Path | None = None) -> SimConfig:
    """Read an engine config.toml; None gives the defaults."""
    if path is None:
        return SimConfig()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise SimConfigError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise SimConfigError(f"{path}: not valid TOML: {e}") from None
    try:
        return sim_config_from_dict(data)
    except SimConfigError as e:
        raise SimConfigError(f"{path}: {e}") from None


def with_overrides(config: SimConfig, overrides: dict[str, dict[str, Any]]) -> SimConfig:
    """A copy with some fields replaced, e.g. {"kv_cache": {"enable": False}}; validated again."""
    data = config.model_dump()
    for section, values in overrides.items():
        data[section].update(values)
    return sim_config_from_dict(data)


# The step costs of [sim]: what a slower GPU multiplies.
STEP_COSTS = (
    "prefill_base_ms",
    "prefill_ms_per_token",
    "decode_step_ms",
    "decode_ms_per_running_seq",
    "no_kv_cache_ms_per_context_token",
)


def slowed(config: SimConfig, factor: float) -> SimConfig:
    """A copy whose prefill and decode steps (and fixed timings, where set) take `factor` times as
    long: one replica of a simulated fleet on a slower or sick GPU."""
    if not factor > 0:
        raise SimConfigError(f"slowdown: must be a positive factor (got {factor!r})")
    sim = config.sim
    change: dict[str, Any] = {k: getattr(sim, k) * factor for k in STEP_COSTS}
    for k in ("fixed_ttft_ms", "fixed_tpot_ms"):
        if getattr(sim, k) is not None:
            change[k] = getattr(sim, k) * factor
    return with_overrides(config, {"sim": change})
