"""Which headers cross infertap, each way: what the client's request carries upstream, what an
upstream's answer carries back."""

from __future__ import annotations

from proxy.core.asgi import Scope

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Never forwarded upstream: credentials (infertap adds the upstream's own) and what the HTTP client sets.
# traceparent/tracestate pass through, so an engine's traces join the caller's even with tracing
# off; the tracing observer replaces them with its attempt span's context.
DROP_REQUEST = _HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "api-key",
    "x-api-key",
    "cookie",
    "accept-encoding",
    # Answered at infertap's edge (uvicorn sends the 100 when the body is read): an upstream that
    # never answers 100 would hold the request until every timeout ran out.
    "expect",
    "x-request-id",
}
DROP_RESPONSE = frozenset(
    h.encode() for h in _HOP_BY_HOP | {"date", "server", "x-request-id", "content-length"}
)


def forwarded_headers(scope: Scope) -> dict[str, str]:
    """The client's headers as they go upstream: no credentials, no hop-by-hop headers (also none
    that the client names in `Connection`), and X-Forwarded-For with the client's address appended."""
    headers: dict[str, str] = {}
    hop: list[str] = []
    forwarded_for: list[str] = []
    for k, v in scope["headers"]:
        name = k.decode("latin-1")
        if name in DROP_REQUEST:
            if name == "connection":
                hop.extend(t.strip().lower() for t in v.decode("latin-1").split(","))
        elif name == "x-forwarded-for":
            forwarded_for.append(v.decode("latin-1"))
        else:
            headers[name] = v.decode("latin-1")
    if hop:
        for name in hop:
            headers.pop(name, None)
        if "x-forwarded-for" in hop:
            forwarded_for.clear()
    client = scope.get("client")
    if client:
        forwarded_for.append(str(client[0]))
    if forwarded_for:
        headers["x-forwarded-for"] = ", ".join(forwarded_for)
    return headers
