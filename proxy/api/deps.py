"""What the ops and operator routes are handed: the running proxy, as a typed FastAPI dependency.

The composition root (proxy/app.py) puts its `Runtime` in the application's state; a route names
`RuntimeDep` and gets it, checked, instead of reaching into the app.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from proxy.control.auth import bearer_matches
from proxy.control.runtime import Runtime

STATE_KEY = "infertap_runtime"


def runtime(request: Request) -> Runtime:
    found = getattr(request.app.state, STATE_KEY, None)
    if not isinstance(found, Runtime):
        raise RuntimeError("this FastAPI app was not built by proxy.app.create_app")
    return found


RuntimeDep = Annotated[Runtime, Depends(runtime)]


def bearer_ok(request: Request, token: str | None) -> bool:
    """No token configured: open. Else the request must present it (constant-time compare)."""
    return token is None or bearer_matches(request.headers.get("authorization"), token)
