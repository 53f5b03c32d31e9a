"""Change the simulated engine's timing while it runs: `POST /admin/timing` and SIGHUP.

Rehearsing an alert means slowing the engine down under live traffic and watching the page
arrive; a restart would reset every counter and look like an outage instead. Only timing can
change (the step costs of [sim], the fixed lane, the batch limits that make requests queue):
the KV cache's size and the model are fixed for the life of the process.

The engine and the fixed lane read `config.sim` / `config.batching` / `config.prefill` at every
step and every request, so replacing those sections on the one shared SimConfig takes effect
with the next step.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.sim.config import (
    BatchingSection,
    PrefillSection,
    SimConfig,
    SimConfigError,
    SimSection,
    _describe,
    load_sim_config,
)

log = logging.getLogger("infertap.sim")

# section -> the keys that may change at run time
TIMING: dict[str, tuple[str, ...]] = {
    "sim": (
        "prefill_base_ms",
        "prefill_ms_per_token",
        "decode_step_ms",
        "decode_ms_per_running_seq",
        "no_kv_cache_ms_per_context_token",
        "fixed_ttft_ms",
        "fixed_tpot_ms",
    ),
    "batching": ("max_num_seqs", "max_num_batched_tokens"),
    "prefill": ("max_prefill_tokens",),
}
_SECTIONS: dict[str, type[BaseModel]] = {
    "sim": SimSection,
    "batching": BatchingSection,
    "prefill": PrefillSection,
}


def timing(config: SimConfig) -> dict[str, dict[str, Any]]:
    return {s: {k: getattr(getattr(config, s), k) for k in keys} for s, keys in TIMING.items()}


def apply_timing(config: SimConfig, change: Any) -> dict[str, dict[str, Any]]:
    """Apply {"sim": {"prefill_ms_per_token": 0.3}, "batching": {...}} to the running config, all
    or nothing; returns the timing now in effect. Unknown or non-timing keys are refused by name."""
    if not isinstance(change, dict):
        raise SimConfigError('the body must be a JSON object such as {"sim": {"prefill_ms_per_token": 0.3}}')
    problems = []
    for section, values in change.items():
        if section not in TIMING:
            problems.append(f"{section}: not a timing section (one of {', '.join(TIMING)})")
        elif not isinstance(values, dict):
            problems.append(f"{section}: must be an object")
        else:
            problems += [
                f"{section}.{k}: cannot change at run time (one of {', '.join(TIMING[section])})"
                for k in values
                if k not in TIMING[section]
            ]
    if problems:
        raise SimConfigError("; ".join(problems))
    new: dict[str, Any] = {}
    for section, values in change.items():
        merged = getattr(config, section).model_dump() | values
        try:
            new[section] = _SECTIONS[section].model_validate(merged)
        except ValidationError as e:
            raise SimConfigError(f"{section}: {_describe(e)}") from None
    for section, value in new.items():  # validated above: assigning cannot fail half-way
        setattr(config, section, value)
    return timing(config)


def reload_timing(config: SimConfig, path: str | Path) -> dict[str, dict[str, Any]]:
    """Re-read the config file and apply its timing keys (SIGHUP)."""
    fresh = load_sim_config(path)
    return apply_timing(config, {s: timing(fresh)[s] for s in TIMING})


def install_sighup(config: SimConfig, path: str | Path | None) -> None:
    """SIGHUP re-reads --config's timing; without a config file there is nothing to re-read."""
    if path is None or not hasattr(signal, "SIGHUP"):
        return

    def reload() -> None:
        try:
            now = reload_timing(config, path)
        except SimConfigError as e:
            log.error("SIGHUP: timing not changed: %s", e)
            return
        log.warning("SIGHUP: timing reloaded from %s: %s", path, now)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _bad(message: str) -> Response:
    return _json({"error": {"message": message, "type": "invalid_request_error"}}, 400)


def admin_routes(config: SimConfig) -> list[Route]:
    async def get(request: Request) -> Response:
        return _json(timing(config))

    async def post(request: Request) -> Response:
        try:
            change = orjson.loads(await request.body())
            now = apply_timing(config, change)
        except orjson.JSONDecodeError:
            return _json(
                {"error": {"message": "the body is not valid JSON", "type": "invalid_request_error"}}, 400
            )
        except SimConfigError as e:
            return _json({"error": {"message": str(e), "type": "invalid_request_error"}}, 400)
        log.warning("timing changed: %s", change)
        return _json(now)

    return [Route("/admin/timing", get, methods=["GET"]), Route("/admin/timing", post, methods=["POST"])]
