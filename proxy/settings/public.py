"""What may be shown of the configuration: in logs, errors, /ui, GET /admin/config and the settings
shared between workers. URLs lose user info and query; secrets are hidden, their names kept."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from proxy.settings.loading import Settings


def display_url(url: str) -> str:
    """The URL without user info or query: safe for logs and error messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


HIDDEN = "(hidden)"
_SECRET_NAME = re.compile(r"key|token|secret|passw|credential|cookie", re.IGNORECASE)


def public_config(settings: Settings) -> dict[str, Any]:
    """`settings.model_dump()` for display: URLs without user info or query, upstream header
    values hidden (only their names shown), and any other string whose field name sounds secret
    hidden, except the names of environment variables and files (`*_env`, `*_file`)."""
    data = settings.model_dump(mode="json")
    for up in data.get("upstreams", []):
        up["base_url"] = display_url(up["base_url"]) if up["base_url"] else ""
        up["replicas"] = [display_url(r) for r in up.get("replicas", [])]
        up["headers"] = {name: HIDDEN for name in up.get("headers", {})}
    tracing = data.get("tracing", {})
    if tracing.get("endpoint"):
        tracing["endpoint"] = display_url(tracing["endpoint"])
    scrubbed: dict[str, Any] = _scrub(data)
    return scrubbed


def _scrub(value: Any, name: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, name) for v in value]
    if (
        isinstance(value, str)
        and value != HIDDEN
        and _SECRET_NAME.search(name)
        and not name.endswith(("_env", "_file"))
    ):
        return HIDDEN
    return value
