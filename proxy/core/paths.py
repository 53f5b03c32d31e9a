"""The path a passthrough request (route `other`) takes upstream, and what may never leave the
upstream's base path or dodge a metered route.

The check reads the path as any server on the way might: percent-decoded once, twice, ... until
stable (IIS's `%uXXXX` included), `\\` read as `/`, `;params` stripped from each segment (Java
servers), cut at NUL. A path any of those readings could take out of the base path, or onto a
proxied route, is refused: infertap forwards the client's bytes, so what it checks is what the
upstream reads.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from proxy.core.asgi import Scope
from proxy.core.route_table import PROXIED

# A path still changing after this many decodings is refused: no client encodes eight times.
MAX_DECODINGS = 8
_PCT_U = re.compile(r"%[uU]([0-9a-fA-F]{4})")
# Where a segment's params start: `;`, also still encoded, as the HTTP client decodes `%3B` (a
# sub-delimiter) while it keeps `%2F`; so `x%3B%2Fy` reaches the upstream as `x;%2Fy`.
_PARAMS = re.compile(r";|%(?:25)*3[bB]")
# The proxied routes as a lenient server would match them (see _canonical).
_PROXIED_CANONICAL = {path.lower(): path for path in PROXIED}


class PathRejected(Exception):
    """A passthrough path that could leave the upstream's base path, or dodge a proxied route."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_path") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _u_escape(m: re.Match[str]) -> str:
    # As latin-1 text, like unquote's output: UTF-8 bytes, checked with everything else.
    return chr(int(m[1], 16)).encode("utf-8", "surrogatepass").decode("latin-1")


def _decode(path: str) -> str:
    if "%u" in path or "%U" in path:
        path = _PCT_U.sub(_u_escape, path)
    return unquote(path, "latin-1")


def readings(suffix: str) -> list[str]:
    """The path as it reads after 0, 1, 2, ... percent-decodings, until stable: the bytes of each
    as latin-1 text."""
    out = [suffix]
    while "%" in out[-1]:
        decoded = _decode(out[-1])
        if decoded == out[-1]:
            break
        if len(out) > MAX_DECODINGS:
            raise PathRejected(f"the path is still percent-encoded after {MAX_DECODINGS} decodings")
        out.append(decoded)
    return out


def segments(reading: str) -> list[list[str]]:
    """The segments lenient servers see, `;params` and surrounding blanks removed: with `\\` read
    as `/` (Windows servers), and without (Java servers strip params but keep `\\`; and the HTTP
    client sends a raw `\\` as `%5C`)."""
    views = [reading, reading.replace("\\", "/")] if "\\" in reading else [reading]
    return [[_PARAMS.split(seg, 1)[0].strip() for seg in view.split("/")] for view in views]


def _canonical(segs: list[str]) -> str:
    """What a lenient server routes by: empty segments (`//`, a trailing `/`) gone, any case."""
    return "/v1/" + "/".join(s for s in segs if s).lower()


def passthrough_suffix(scope: Scope) -> str:
    """The path after `/v1` of a passthrough request, as the client sent it (percent-encoding kept,
    so a `%2F` inside a model id stays one path segment upstream).

    Raises PathRejected (400) for a path that, read as some server on the way reads it, has a dot
    segment (`.`, `..`, also `..;x` or `%2e%2e` at any depth of encoding), a NUL, or bytes that are
    not UTF-8 (`%c0%ae` is an overlong `.`); and (404) for a variant of a proxied route
    (`/v1/chat/completions/`, `;x`, `//`, another case), which would reach the upstream as route
    `other`, with neither model routing nor metering.
    """
    raw: bytes | None = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else scope["path"]
    if not path.startswith("/v1/"):
        raise PathRejected("the path must start with /v1/ as sent, not percent-encoded")
    suffix = path[3:]
    for reading in readings(suffix):
        if "\x00" in reading:
            raise PathRejected("the path has a NUL byte (plain or percent-encoded)")
        if not reading.isascii():
            try:
                reading.encode("latin-1").decode("utf-8")
            except UnicodeDecodeError:
                raise PathRejected(
                    "the path is not UTF-8 once percent-decoded (an overlong or invalid sequence)"
                ) from None
        for segs in segments(reading):
            # Only dots: `.`, `..`, and `...` or `.. ` that Windows servers trim to one of those.
            if any(seg and not seg.strip(".") for seg in segs):
                raise PathRejected(
                    "the path has a '.' or '..' segment (plain, percent-encoded or with ;params)"
                )
            canonical = _PROXIED_CANONICAL.get(_canonical(segs))
            if canonical is not None:
                raise PathRejected(
                    f"no such route: send {canonical} exactly (a variant of it would skip model "
                    "routing and metering)",
                    404,
                    "unknown_route",
                )
    return suffix
