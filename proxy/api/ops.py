"""The ops routes, as FastAPI endpoints with typed answers: /healthz, /readyz, /metrics, /v1/models,
the /ui page; and infertap's one error shape for everything FastAPI answers.

None of these is on the hot path: the proxied OpenAI routes never reach FastAPI (app.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import TYPE_CHECKING, Any, cast

import orjson
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from proxy import __version__
from proxy.control.upstream_checks import probe_models
from proxy.core.asgi import Receive, Scope, Send, error_body
from proxy.core.errors import UpstreamError

if TYPE_CHECKING:
    from proxy.app import InfertapApp

log = logging.getLogger("infertap.app")

PROBE_TIMEOUT = 3.0
NOT_FOUND = (
    "infertap serves /v1/* (the OpenAI API), /healthz, /readyz, /status, /metrics, /ui, /docs and /admin/*"
)


class ApiError(Exception):
    """An OpenAI-style error answer from an ops or operator endpoint."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="an infertap error kind or an OpenAI error type")
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error shape, for infertap's own errors and the upstream's alike."""

    error: ErrorDetail


class Health(BaseModel):
    status: str = Field(examples=["ok"])
    version: str


class Ready(BaseModel):
    status: str = Field(description="ready, or why not (starting, draining, every circuit open)")


class ModelList(BaseModel):
    object: str = "list"
    data: list[dict[str, Any]] = Field(description="each upstream's models, with an `upstream` field added")


def the_app(request: Request) -> InfertapApp:
    return cast("InfertapApp", request.app)


def bearer_ok(request: Request, token: str | None) -> bool:
    return token is None or hmac.compare_digest(
        request.headers.get("authorization", "").encode(), f"Bearer {token}".encode()
    )


def unauthorized(path: str, setting: str) -> ApiError:
    return ApiError(
        401,
        f"{path} needs 'Authorization: Bearer <token>' ({setting})",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


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
async def readyz(request: Request) -> Response:
    ready, why = the_app(request).ready()
    return Response(orjson.dumps({"status": why}), 200 if ready else 503, media_type="application/json")


@router.get(
    "/status",
    summary="Each upstream's reachability (background checks) and circuit (the metrics token)",
    responses={401: {"model": ErrorResponse}},
)
async def status(request: Request) -> Response:
    app = the_app(request)
    if not bearer_ok(request, app.access.metrics_token):
        raise unauthorized("/status", "auth.metrics_token_env")
    ready, _ = app.ready()
    rt = app.runtime
    return Response(orjson.dumps(rt.checker.status(rt.drain.draining, ready)), media_type="application/json")


@router.get(
    "/metrics",
    summary="Prometheus metrics (the metrics token when auth.metrics_token_env is set)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, 401: {"model": ErrorResponse}},
)
async def metrics(request: Request) -> Response:
    app = the_app(request)
    if app.metrics is None:
        raise StarletteHTTPException(404)
    if not bearer_ok(request, app.access.metrics_token):
        raise unauthorized("/metrics", "auth.metrics_token_env")
    body, content_type = app.metrics.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)


@router.get(
    "/v1/models",
    response_model=ModelList,
    summary="Every upstream's model list, merged",
    responses={502: {"model": ErrorResponse, "description": "no upstream answered"}},
)
async def models(request: Request) -> Response:
    app = the_app(request)
    ups = app.routing.upstreams
    results = await asyncio.gather(*(probe_models(app.runtime.client, u, PROBE_TIMEOUT) for u in ups))
    data: list[dict[str, Any]] = []
    seen: set[Any] = set()
    failures: list[str] = []
    for up, res in zip(ups, results, strict=True):
        if isinstance(res, UpstreamError) or res.status != 200:
            failures.append(f"{up.name}: {res if isinstance(res, UpstreamError) else f'HTTP {res.status}'}")
            continue
        try:
            listed = orjson.loads(res.body).get("data", [])
        except (orjson.JSONDecodeError, AttributeError):
            failures.append(f"{up.name}: not an OpenAI model list")
            continue
        for model in listed:
            # A model two upstreams serve is listed once, under the first (routing order).
            if isinstance(model, dict) and model.get("id") not in seen:
                seen.add(model.get("id"))
                data.append({**model, "upstream": up.name})
    if failures:
        log.warning("model list incomplete: %s", "; ".join(failures))
    if not data and failures:
        msg = "no upstream answered the model list: " + "; ".join(failures)
        raise ApiError(502, msg, "upstream_error", "upstream_unreachable")
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


class RawRoute:
    """A raw ASGI handler (the /ui page's) as a Starlette route endpoint: no request parsing."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


def raw_routes(table: dict[tuple[str, str], Any]) -> list[Route]:
    return [
        Route(path, RawRoute(h), methods=[method], include_in_schema=False)
        for (method, path), h in table.items()
    ]


def install_error_handlers(api: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        e = cast(ApiError, exc)
        return Response(error_body(e.message, e.kind, e.code), e.status, e.headers, "application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        e = cast(StarletteHTTPException, exc)
        method, path = request.method, request.url.path
        if e.status_code == 404:
            body = error_body(f"no route {method} {path}: {NOT_FOUND}", "invalid_request_error", "not_found")
        elif e.status_code == 405:
            body = error_body(
                f"{path} does not accept {method}", "invalid_request_error", "method_not_allowed"
            )
        else:
            body = error_body(str(e.detail), "invalid_request_error")
        return Response(body, e.status_code, dict(e.headers or {}), "application/json")

    async def invalid(request: Request, exc: Exception) -> Response:
        errors = cast(RequestValidationError, exc).errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else "request"
        msg = f"{where}: {errors[0]['msg']}" if errors else "invalid request"
        return Response(
            error_body(msg, "invalid_request_error", "invalid_request"), 400, None, "application/json"
        )

    api.add_exception_handler(ApiError, api_error)
    api.add_exception_handler(StarletteHTTPException, http_error)
    api.add_exception_handler(RequestValidationError, invalid)
