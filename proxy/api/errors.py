"""infertap's one error shape (OpenAI's) for everything FastAPI answers: ApiError, its documented
model, and the handlers that turn FastAPI's and Starlette's own errors into it."""

from __future__ import annotations

from typing import cast

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.core.asgi import error_body

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


def unauthorized(path: str, setting: str) -> ApiError:
    return ApiError(
        401,
        f"{path} needs 'Authorization: Bearer <token>' ({setting})",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


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
