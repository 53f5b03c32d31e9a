"""Which headers cross infertap, each way: an allow-list for what a client's request carries to an
upstream, and one for what an upstream's answer carries back (docs/security.md states both).

Both run once per request, not per chunk: one frozenset lookup per header (and, for names not in
it, one `startswith` over a tuple of prefixes)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_plus

from proxy.core.asgi import RawHeaders

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Never forwarded, whatever an upstream allows: credentials (infertap sends the upstream's own key),
# framing the HTTP client sets, and what infertap sets itself (x-request-id, x-forwarded-for).
# `expect` is answered at infertap's edge: an upstream that never answers 100 would hold the request.
NEVER_FORWARDED = HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "api-key",
    "x-api-key",
    "cookie",
    "accept-encoding",
    "expect",
    "x-request-id",
    "x-forwarded-for",
}
# What OpenAI clients legitimately send. Billing selectors (openai-organization, openai-project) and
# routing rewrites (x-forwarded-host/-proto, forwarded, x-real-ip, x-original-url, x-rewrite-url,
# x-http-method-override) are not here: an upstream's `forward_headers` may add them.
DEFAULT_FORWARDED = (
    "content-type",
    "content-encoding",
    "accept",
    "user-agent",
    "openai-beta",
    "x-stainless-*",  # the OpenAI SDKs' telemetry (language, version, retry count, timeout)
    "traceparent",  # validated: a malformed one is dropped, with its tracestate
    "tracestate",
    "baggage",
    "idempotency-key",
)
# Never returned to a client: credentials and cookies of the upstream's, its HSTS (which would pin
# infertap's host), framing, and what infertap sets itself.
NEVER_RETURNED = HOP_BY_HOP | {
    "authorization",
    "set-cookie",
    "set-cookie2",
    "www-authenticate",
    "strict-transport-security",
    "content-length",
    "date",
    "server",
    "x-request-id",
}
DEFAULT_RETURNED = (
    "content-type",
    "content-encoding",  # asked for identity; an upstream that compresses anyway is relayed as sent
    "content-language",
    "content-disposition",
    "cache-control",
    "etag",
    "last-modified",
    "retry-after",
    "x-ratelimit-*",
    "ratelimit",
    "ratelimit-policy",
    "openai-model",
    "openai-processing-ms",
    "openai-version",
)
# W3C Trace Context, version 00 (and future versions' first four fields): anything else is dropped.
_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[^\s]*)?")


def valid_traceparent(v: bytes) -> bool:
    if not _TRACEPARENT.fullmatch(v) or v[:2] == b"ff":
        return False
    if v[:2] == b"00" and len(v) != 55:
        return False
    return v[3:35] != b"0" * 32 and v[36:52] != b"0" * 16


@dataclass(frozen=True, slots=True)
class HeaderPolicy:
    """Names (lowercase) that pass, and prefixes (from `name-*` patterns) whose names pass."""

    names: frozenset[bytes]
    prefixes: tuple[bytes, ...]
    # Each name's answer, once it has been asked (bounded: a client's names are its own choosing):
    # SDK telemetry names (x-stainless-*) then cost one lookup, like the exact names.
    seen: dict[bytes, bool] = field(default_factory=dict, compare=False, repr=False)
    # And, for a request's headers, each name as the str it goes upstream as ("" where it does not):
    # one lookup a header, no call and no decoding of the name.
    keys: dict[bytes, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, patterns: Iterable[str], never: frozenset[str]) -> HeaderPolicy:
        names: set[bytes] = set()
        prefixes: list[bytes] = []
        for p in patterns:
            p = p.strip().lower()
            if p.endswith("*"):
                prefixes.append(p[:-1].encode("latin-1"))
            elif p not in never:
                names.add(p.encode("latin-1"))
        # What is never allowed is answered from the start: no pattern (`x-*`, `*`) can let it in.
        return cls(frozenset(names), tuple(sorted(set(prefixes))), {n.encode(): False for n in never})

    def allows(self, name: bytes) -> bool:
        ok = self.seen.get(name)
        if ok is None:
            ok = name in self.names or (bool(self.prefixes) and name.startswith(self.prefixes))
            if len(self.seen) < 2048:
                self.seen[name] = ok
        return ok

    def key(self, name: bytes) -> str:
        """`name` decoded where the policy lets it pass, else "" (kept in `keys`, as `seen` is)."""
        key = name.decode("latin-1") if self.allows(name) else ""
        if len(self.keys) < 2048:
            self.keys[name] = key
        return key


def request_policy(extra: Iterable[str] = ()) -> HeaderPolicy:
    return HeaderPolicy.of((*DEFAULT_FORWARDED, *extra), NEVER_FORWARDED)


def response_policy(extra: Iterable[str] = ()) -> HeaderPolicy:
    return HeaderPolicy.of((*DEFAULT_RETURNED, *extra), NEVER_RETURNED)


DEFAULT_REQUEST_POLICY = request_policy()
DEFAULT_RESPONSE_POLICY = response_policy()


def _connection_tokens(v: bytes) -> list[bytes]:
    return [t.strip().lower() for t in v.split(b",")]


def forwarded_headers(
    raw: Iterable[tuple[bytes, bytes]], client: Any, policy: HeaderPolicy
) -> dict[str, str]:
    """The client's headers as they go upstream: only what `policy` allows (never a credential,
    never a hop-by-hop header nor one that `Connection` names), duplicates comma-joined in order
    (RFC 9110 5.3), a malformed traceparent dropped with its tracestate, and X-Forwarded-For with
    the client's address appended."""
    keys = policy.keys
    headers: dict[str, str] = {}
    hop: list[bytes] = []
    forwarded_for: list[bytes] = []
    for name, v in raw:
        key = keys.get(name)
        if key is None:
            key = policy.key(name)
        if key:
            prior = headers.get(key)
            value = v.decode("latin-1")
            headers[key] = value if prior is None else prior + ", " + value
        # Never allowed by any policy (NEVER_FORWARDED), so asked only of what it refused:
        elif name == b"x-forwarded-for":
            forwarded_for.append(v)
        elif name == b"connection":
            hop.extend(_connection_tokens(v))
    if hop:
        for name in hop:
            headers.pop(name.decode("latin-1"), None)
        if b"x-forwarded-for" in hop:
            forwarded_for.clear()
    trace = headers.get("traceparent")
    # A duplicated traceparent arrives joined, and is malformed like any other invalid one.
    if trace is not None and not valid_traceparent(trace.encode("latin-1")):
        del headers["traceparent"]
        headers.pop("tracestate", None)
    elif trace is None:
        headers.pop("tracestate", None)
    if client:
        forwarded_for.append(str(client[0]).encode("latin-1"))
    if forwarded_for:
        headers["x-forwarded-for"] = b", ".join(forwarded_for).decode("latin-1")
    return headers


def returned_headers(raw: Iterable[tuple[bytes, bytes]], policy: HeaderPolicy) -> RawHeaders:
    """An upstream's answer headers as they go to the client: only what `policy` allows, never a
    credential, a cookie, or a header that the answer's `Connection` names."""
    out: RawHeaders = []
    hop: list[bytes] | None = None
    for k, v in raw:
        name = k.lower()
        if name == b"connection":
            hop = _connection_tokens(v)
        elif policy.allows(name):
            out.append((name, v))
    if hop:
        out = [(k, v) for k, v in out if k not in hop]
    return out


# Query parameters that carry a credential (compared lowercase, percent-decoded, `-` as `_`): some
# servers accept a key as `?api_key=` or `?key=`; infertap sends the upstream's own in a header.
_QUERY_CREDENTIALS = frozenset(
    {"key", "api_key", "apikey", "access_token", "token", "auth", "authorization", "password", "secret"}
)
_QUERY_CREDENTIAL_ENDINGS = ("_key", "_token", "_secret", "password")


def _credential_param(name: str) -> bool:
    n = unquote_plus(name).strip().lower().replace("-", "_")
    return n in _QUERY_CREDENTIALS or n.endswith(_QUERY_CREDENTIAL_ENDINGS)


def forwarded_query(query: bytes) -> str:
    """The query string as it goes upstream ('' or '?...'): every parameter as sent, in order,
    except those that name a credential."""
    if not query:
        return ""
    text = query.decode("latin-1")
    kept = [p for p in text.split("&") if p and not _credential_param(p.split("=", 1)[0])]
    return "?" + "&".join(kept) if kept else ""
