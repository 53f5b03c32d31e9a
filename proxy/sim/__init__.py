"""The simulated OpenAI-compatible engine: prefill/decode/KV-cache timing, vLLM-style /metrics."""

from __future__ import annotations

from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig, SimConfigError, load_sim_config

__all__ = ["SimConfig", "SimConfigError", "create_sim_app", "load_sim_config"]
