"""The OpenAPI document: the operator and ops API as FastAPI generates it, plus the proxied OpenAI
routes, described (not registered: no FastAPI request parsing runs for them) with what infertap adds.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from proxy import __version__
from proxy.core.errors import ERRORS
from proxy.core.route_table import OTHER, PROXIED, Route

DESCRIPTION = """\
infertap relays the OpenAI API to its upstreams and measures what users feel (TTFT, TPOT, tokens,
retries, timeouts). The **proxied** routes are relayed byte for byte; infertap parses only what it
must (the model and `stream` of a JSON body) and adds the headers and error answers listed on each.
The **operator** routes need the admin token (`auth.admin_token_env`).
"""

_HEADERS = {
    "X-Request-Id": {
        "description": "the request's id: the client's own X-Request-Id when it sent a usable one",
        "schema": {"type": "string"},
    },
}
_STREAM_HEADERS = {
    "X-Accel-Buffering": {"description": "`no` on streams", "schema": {"type": "string"}},
    "Cache-Control": {"description": "`no-cache` on streams", "schema": {"type": "string"}},
}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": _HEADERS,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def _operation(route: Route) -> dict[str, Any]:
    kinds = ", ".join(sorted({k.value for k, i in ERRORS.items() if i.outcome is not None}))
    description = (
        f"Relayed to the upstream that serves the body's `model` (route label `{route.label}`). "
        "Retries and fallback happen only before anything is sent to the client."
    )
    if route.generation:
        description += (
            " On a stream, a failure after the first token is an in-band SSE event "
            '`data: {"error": {"type": KIND, ...}}`, never a silent clean end.'
        )
    responses: dict[str, Any] = {
        "200": {
            "description": "the upstream's answer, bytes unchanged"
            + (" (text/event-stream when `stream` is true)" if route.generation else ""),
            "headers": {**_HEADERS, **(_STREAM_HEADERS if route.generation else {})},
        },
        "400": _error("infertap rejected the body (not JSON, no `model`, bad `stream`) or a path"),
        "401": _error("a client key is required ([auth]) and none or a wrong one was sent"),
        "413": _error("the body is larger than server.max_body_bytes"),
        "429": _error("the upstream's 429 after retries, or infertap's own concurrency cap"),
        "502": _error(f"the upstream failed before the first byte; `type` is one of: {kinds}"),
        "503": _error("every candidate upstream's circuit is open"),
        "504": _error("a connect, ttft or total timeout"),
    }
    op: dict[str, Any] = {
        "tags": ["proxied (OpenAI API)"],
        "summary": route.summary,
        "description": description,
        "operationId": f"proxy_{route.label.replace('.', '_')}",
        "responses": responses,
    }
    if route.json_body:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"type": "object", "required": ["model"]}}},
        }
    return op


def build_openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(
        title="infertap",
        version=__version__,
        description=DESCRIPTION,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    paths = schema.setdefault("paths", {})
    for route in PROXIED.values():
        paths[route.path] = {route.method.lower(): _operation(route)}
    paths["/v1/{path}"] = {
        method: {
            **_operation(OTHER),
            "operationId": f"proxy_other_{method}",
            "parameters": [{"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}],
        }
        for method in ("get", "post", "delete")
    }
    schema.setdefault("components", {}).setdefault("schemas", {}).setdefault("ErrorResponse", _error_schema())
    app.openapi_schema = schema
    return schema


def _error_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
