"""The operator API: GET /admin/upstreams, GET /admin/config, POST /admin/reload.

Protected by its own bearer token (auth.admin_token_env; without one the operator API is off),
and served only on [server] admin_port when that is set. Typed answers, documented at /docs.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from proxy.api.deps import RuntimeDep, bearer_ok
from proxy.api.errors import ApiError, ErrorResponse, unauthorized
from proxy.observe.upstream_stats import p50
from proxy.settings import RELOADABLE, ConfigError, public_config


def require_admin(request: Request, runtime: RuntimeDep) -> None:
    token = runtime.access.admin_token
    if token is None:
        raise ApiError(
            403,
            "the operator API is off: set auth.admin_token_env to the name of an environment variable "
            "that holds its token",
            code="admin_api_off",
        )
    if not bearer_ok(request, token):
        raise unauthorized(request.url.path, "auth.admin_token_env")


router = APIRouter(
    prefix="/admin",
    tags=["operator"],
    dependencies=[Depends(require_admin)],
    responses={
        401: {"model": ErrorResponse, "description": "no or a wrong admin token"},
        403: {"model": ErrorResponse, "description": "the operator API is off (no auth.admin_token_env)"},
    },
)


class Circuit(BaseModel):
    """The circuit breaker's state (proxy/core/circuit.py), as GET /status shows it."""

    state: str = Field(description="closed, open or half_open (one probe request decides)")
    why: str | None = Field(description="why it is open")
    retry_in_seconds: float = Field(description="until the next probe may go; 0 when closed")
    window_calls: int = Field(description="attempts in the sliding window")
    window_failures: int


class LastFailure(BaseModel):
    outcome: str
    message: str | None
    at: float = Field(description="unix seconds")


class ReplicaState(BaseModel):
    address: str = Field(description="the replica's base URL, without user info or query")
    state: str = Field(description="up, ejected (its circuit open) or draining (it left the pool)")
    in_flight: int
    ttft_seconds: float | None = Field(description="recent time to first token there (a moving average)")
    tpot_seconds: float | None
    why: str | None = Field(description="why it is ejected, and when it is probed again")


class UpstreamState(BaseModel):
    name: str
    base_url: str = Field(description="without user info or query")
    default: bool
    models: list[str]
    fallback: list[str]
    circuit: Circuit
    reachable: bool | None = Field(description="the last background check's verdict; none before the first")
    last_check: float | None = Field(description="unix seconds")
    check_error: str | None
    in_flight: int
    requests: int = Field(description="requests that ended there since start")
    failures: int
    last_failure: LastFailure | None
    ttft_p50_seconds: float | None = Field(description="over its most recent requests")
    tpot_p50_seconds: float | None = Field(description="over its most recent successful requests")
    config_warnings: list[str]
    balance: str | None = Field(default=None, description="a pool's policy; none for a single base_url")
    replicas: list[ReplicaState] | None = Field(default=None, description="a pool's replicas")


class EffectiveConfig(BaseModel):
    config: dict[str, Any] = Field(description="the running configuration, every secret redacted")
    reloadable: list[str] = Field(description="sections that POST /admin/reload applies")
    reloaded_at: float | None = Field(description="unix seconds of the last reload; none since start")


class ReloadResult(BaseModel):
    reloaded: bool
    applied: list[str] = Field(description="sections that changed and now apply to new requests")
    restart_needed: list[str] = Field(description="sections that changed but run on until a restart")
    workers: int = Field(
        description="worker processes that had applied it when this answer was sent (acknowledged, "
        "not assumed). With --workers N the answer waits up to 2 s for every running worker: an idle "
        "one applies it within half a second, a busy one before its next request. Fewer than "
        "`workers_running` means some had not by then (a blocked event loop, or the reload failed "
        "there and its log says why); they still apply it before their next request if they can. "
        "1 without --workers."
    )
    workers_running: int = Field(description="worker processes running when this answer was sent")


@router.get("/upstreams", response_model=list[UpstreamState], summary="Each upstream's state")
async def upstreams(runtime: RuntimeDep) -> list[UpstreamState]:
    # The background checks' and the breakers' view, as GET /status has it; traffic from UpstreamStats.
    status = {row["name"]: row for row in runtime.status()["upstreams"]}
    rows = []
    routing = runtime.routing
    for up in routing.upstreams:
        s = status[up.name]
        t = runtime.stats.traffic(up.name)
        fail = t.last_failure
        rows.append(
            UpstreamState(
                name=up.name,
                base_url=up.display_url,
                default=up is routing.default,
                models=up.models,
                fallback=up.fallback,
                circuit=Circuit.model_validate(s["circuit"]),
                reachable=s["reachable"],
                last_check=s["last_check"],
                check_error=s["check_error"],
                in_flight=t.in_flight,
                requests=t.requests,
                failures=t.failures,
                last_failure=None
                if fail is None
                else LastFailure(outcome=fail.outcome, message=fail.message, at=fail.at),
                ttft_p50_seconds=p50(t.ttft),
                tpot_p50_seconds=p50(t.tpot),
                config_warnings=list(up.config_warnings),
                balance=s.get("balance"),
                replicas=[ReplicaState.model_validate(r) for r in s["replicas"]] if "replicas" in s else None,
            )
        )
    return rows


@router.get("/config", response_model=EffectiveConfig, summary="The running configuration, secrets redacted")
async def config(runtime: RuntimeDep) -> EffectiveConfig:
    return EffectiveConfig(
        config=public_config(runtime.settings), reloadable=list(RELOADABLE), reloaded_at=runtime.reloaded_at
    )


@router.post(
    "/reload",
    response_model=ReloadResult,
    summary="Reload the configuration file (as SIGHUP does)",
    description="Upstreams and routing, keys, timeouts, retries and the circuit settings apply to new "
    "requests; requests in flight finish on the settings they started with. With --workers N every "
    "worker applies it (none restarts), and `workers` counts those that had when the answer was sent "
    "(it waits up to 2 s for them). Two reloads at once run one after the other: the one that read "
    "the file last is the one every worker ends on. A file that does not load is rejected with the "
    "field named, and the running configuration stays, in every worker.",
    responses={
        400: {"model": ErrorResponse, "description": "the file is invalid: nothing changed"},
        409: {"model": ErrorResponse, "description": "this infertap has no configuration file to reload"},
    },
)
async def reload(runtime: RuntimeDep) -> ReloadResult:
    reloader = runtime.reloader
    if reloader is None:
        raise ApiError(409, "this infertap was started without a configuration to reload", code="no_reload")
    try:
        applied = reloader.reload()
    except ConfigError as e:
        raise ApiError(
            400, f"the configuration was NOT reloaded (the running one stays): {e}", code="invalid_config"
        ) from None
    workers, running = await runtime.acknowledged(applied.generation)
    return ReloadResult(
        reloaded=True,
        applied=applied.changed,
        restart_needed=applied.restart_needed,
        workers=workers,
        workers_running=running,
    )
