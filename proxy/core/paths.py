"""The path a passthrough request (route `other`) takes upstream, and what may never leave the
upstream's base path."""

from __future__ import annotations

from urllib.parse import unquote

from proxy.core.asgi import Scope


class PathRejected(Exception):
    """A passthrough path that could leave the upstream's base path."""


def passthrough_suffix(scope: Scope) -> str:
    """The path after `/v1` of a passthrough request, as the client sent it (percent-encoding kept,
    so a `%2F` inside a model id stays one path segment upstream).

    Raises PathRejected for a path with a `.` or `..` segment, plain or percent-encoded (also
    behind `\\`, which some servers treat as `/`): once normalized, by the HTTP client or by
    the upstream, it could leave the upstream's base path with the upstream's key attached.
    """
    raw: bytes | None = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else scope["path"]
    if not path.startswith("/v1/"):
        raise PathRejected("the path must start with /v1/ as sent, not percent-encoded")
    suffix = path[3:]
    # A dot segment needs "/." once decoded: only a path with "/.", "%" or "\\" needs the slow look.
    if "/." in suffix or "%" in suffix or "\\" in suffix:
        decoded = suffix
        for _ in range(3):  # double (and triple) encoding: a server that decodes twice sees this
            decoded = unquote(decoded, "latin-1").replace("\\", "/")
            if any(seg in (".", "..") for seg in decoded.split("/")):
                raise PathRejected("the path has a '.' or '..' segment (plain or percent-encoded)")
            if "%" not in decoded:
                break
    return suffix
