"""/docs: Swagger UI, with its assets served by infertap itself from a pinned package (fastapi-offline
ships them), so the page works in an air-gapped cluster and loads nothing from a CDN."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS = "/docs"
ASSETS = "/docs/assets"


def install_docs(app: FastAPI, openapi_url: str) -> None:
    static = Path(str(resources.files("fastapi_offline") / "static"))
    app.mount(ASSETS, StaticFiles(directory=static), name="docs-assets")

    @app.get(DOCS, include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
        )
