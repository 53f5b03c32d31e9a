"""The ops routes, as FastAPI endpoints with typed answers: /healthz, /readyz, /status, /metrics and
GET /v1/models. Each gets the running proxy as a typed dependency (deps.py).

None of these is on the hot path: the proxied OpenAI routes never reach FastAPI
(proxy/control/dispatch.py).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy import __version__
from proxy.api.deps import RuntimeDep, bearer_ok
from proxy.api.errors import ApiError, ErrorResponse, unauthorized


class Health(BaseModel):
    status: str = Field(examples=["ok"])
    version: str


class Ready(BaseModel):
    status: str = Field(description="ready, or why not (starting, draining, every circuit open)")


class ModelList(BaseModel):
    object: str = "list"
    data: list[dict[str, Any]] = Field(description="each upstream's models, with an `upstream` field added")


router = APIRouter(tags=["ops"])


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> Health:
    return Health(status="ok", version=__version__)


@router.get(
    "/readyz",
    response_model=Ready,
    summary="Readiness, from the process's own state: answers at once (not ready while draining)",
    responses={
        503: {"model": Ready, "description": "starting, draining, or (ready_needs_upstream) no upstream"}
    },
)
async def readyz(runtime: RuntimeDep) -> Response:
    ready, why = runtime.ready()
    return Response(orjson.dumps({"status": why}), 200 if ready else 503, media_type="application/json")


@router.get(
    "/status",
    summary="Each upstream's reachability (background checks) and circuit (the metrics token)",
    responses={401: {"model": ErrorResponse}},
)
async def status(request: Request, runtime: RuntimeDep) -> Response:
    if not bearer_ok(request, runtime.access.metrics_token):
        raise unauthorized("/status", "auth.metrics_token_env")
    return Response(orjson.dumps(runtime.status()), media_type="application/json")


@router.get(
    "/metrics",
    summary="Prometheus metrics (the metrics token when auth.metrics_token_env is set)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, 401: {"model": ErrorResponse}},
)
async def metrics(request: Request, runtime: RuntimeDep) -> Response:
    if runtime.metrics is None:
        raise StarletteHTTPException(404)
    if not bearer_ok(request, runtime.access.metrics_token):
        raise unauthorized("/metrics", "auth.metrics_token_env")
    body, content_type = runtime.metrics.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)


@router.get(
    "/v1/models",
    response_model=ModelList,
    summary="Every upstream's model list, merged (fetched at most [server] models_cache_seconds ago)",
    responses={502: {"model": ErrorResponse, "description": "no upstream answered"}},
)
async def models(runtime: RuntimeDep) -> Response:
    union = await runtime.model_union()
    if not union.listed and union.failures:
        msg = "no upstream answered the model list: " + "; ".join(union.failures)
        raise ApiError(502, msg, "upstream_error", "upstream_unreachable")
    return Response(union.body, media_type="application/json")
