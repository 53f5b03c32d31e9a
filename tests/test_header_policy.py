"""The header policy, both ways (docs/security.md): what a client's request carries to an upstream
is exactly an allow-list (the default plus the upstream's `forward_headers`), and what an upstream's
answer carries back is exactly the response allow-list. Through a real infertap, to a recording
upstream; the randomized tests' oracle is written here, apart from proxy/core/headers.py.

INFERTAP_HEADER_EXAMPLES sets the randomized tests' examples (default 30; the long profile: 500)."""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.asgi import Receive, Scope, Send
from proxy.core.headers import forwarded_headers, request_policy
from proxy.settings import Settings, UpstreamSettings
from tests.conftest import CHAT, run_proxy, serve_in_thread

EXAMPLES = int(os.environ.get("INFERTAP_HEADER_EXAMPLES", "30"))
KEY_ENV = "INFERTAP_TEST_HEADER_KEY"
SECRET = "sk-header-policy-secret-77"

# The oracle: what the docs promise, written independently of the code.
FORWARDED = {
    "content-type",
    "content-encoding",
    "accept",
    "user-agent",
    "openai-beta",
    "traceparent",
    "tracestate",
    "baggage",
    "idempotency-key",
    "openai-organization",  # this test's upstream allows it (forward_headers)
}
FORWARDED_PREFIXES = ("x-stainless-", "x-allowed-")  # the second: this upstream's `x-allowed-*`
# Set by infertap or its HTTP client, whatever the client sent.
OWN_REQUEST = {
    "authorization",
    "x-request-id",
    "x-forwarded-for",
    "accept-encoding",
    "host",
    "content-length",
}
RETURNED = {
    "content-type",
    "content-encoding",
    "content-language",
    "content-disposition",
    "cache-control",
    "etag",
    "last-modified",
    "retry-after",
    "ratelimit",
    "ratelimit-policy",
    "openai-model",
    "openai-processing-ms",
    "openai-version",
    "x-upstream-extra",  # this test's upstream allows it (return_headers)
}
RETURNED_PREFIXES = ("x-ratelimit-",)
OWN_RESPONSE = {"x-request-id", "content-length", "transfer-encoding", "date", "server"}

BILLING_AND_ROUTING = [
    "openai-project",
    "x-forwarded-host",
    "x-forwarded-proto",
    "forwarded",
    "x-real-ip",
    "x-original-url",
    "x-rewrite-url",
    "x-http-method-override",
]
CREDENTIALS = ["authorization", "api-key", "x-api-key", "cookie", "proxy-authorization"]
VALID_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Recorder:
    """An upstream that records each request's raw headers and answers with scripted headers."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[tuple[str, str]], str]] = []
        self.answer: list[tuple[bytes, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                done = msg["type"] == "lifespan.shutdown"
                await send({"type": msg["type"] + ".complete"})
                if done:
                    return
        while (await receive()).get("more_body"):
            pass
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        self.requests.append((headers, scope["query_string"].decode("latin-1")))
        body = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "model": "m"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), *self.answer],
            }
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def edge() -> Iterator[tuple[Recorder, str]]:
    os.environ[KEY_ENV] = SECRET
    rec = Recorder()
    with serve_in_thread(rec) as url:
        up = UpstreamSettings(
            name="rec",
            base_url=url + "/v1",
            api_key_env=KEY_ENV,
            forward_headers=["openai-organization", "x-allowed-*"],
            return_headers=["x-upstream-extra"],
        )
        with run_proxy(Settings(upstreams=[up])) as proxy:
            yield rec, proxy
    os.environ.pop(KEY_ENV, None)


def send(
    base: str, headers: list[tuple[str, str]], path: str = "/v1/chat/completions", body: bytes | None = None
) -> tuple[int, list[tuple[str, str]]]:
    """Sends these header lines as they are, duplicates included (http.client's putheader)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    data = json.dumps(CHAT).encode() if body is None else body
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for k, v in headers:
            conn.putheader(k, v)
        conn.putheader("content-length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        resp.read()
        return resp.status, [(k.lower(), v) for k, v in resp.getheaders()]
    finally:
        conn.close()


def joined(headers: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers:
        out[k] = v if k not in out else out[k] + ", " + v
    return out


# -- item 7: what reaches the upstream ---------------------------------------------------------
def test_billing_routing_and_credential_headers_stay_here(edge: tuple[Recorder, str]) -> None:
    rec, proxy = edge
    sent = [(n, "evil") for n in BILLING_AND_ROUTING + CREDENTIALS]
    sent += [
        ("openai-beta", "assistants=v2"),
        ("x-stainless-lang", "python"),
        ("content-type", "application/json"),
    ]
    status, _ = send(proxy, sent)
    assert status == 200
    seen = dict(rec.requests[-1][0])
    for name in BILLING_AND_ROUTING:
        assert name not in seen, f"{name} reached the upstream"
    assert seen["authorization"] == f"Bearer {SECRET}"
    assert "api-key" not in seen and "x-api-key" not in seen and "cookie" not in seen
    assert seen["openai-beta"] == "assistants=v2" and seen["x-stainless-lang"] == "python"


def test_an_upstream_may_allow_a_billing_header(edge: tuple[Recorder, str]) -> None:
    rec, proxy = edge
    send(proxy, [("content-type", "application/json"), ("openai-organization", "org-1")])
    assert dict(rec.requests[-1][0])["openai-organization"] == "org-1"


def test_credentials_in_the_query_string_stay_here(edge: tuple[Recorder, str]) -> None:
    rec, proxy = edge
    ct = [("content-type", "application/json")]
    send(proxy, ct, "/v1/chat/completions?api_key=sk-client&x=1&key=k&Access-Token=t&api-version=2024")
    assert rec.requests[-1][1] == "x=1&api-version=2024"
    send(proxy, ct, "/v1/chat/completions?api_key=sk-client")
    assert rec.requests[-1][1] == ""


def test_malformed_traceparent_is_dropped_and_a_valid_one_kept(edge: tuple[Recorder, str]) -> None:
    rec, proxy = edge
    ct = ("content-type", "application/json")
    send(proxy, [ct, ("traceparent", "00-zz-not-a-trace"), ("tracestate", "a=b")])
    seen = dict(rec.requests[-1][0])
    assert "traceparent" not in seen and "tracestate" not in seen
    send(proxy, [ct, ("traceparent", VALID_TRACEPARENT), ("tracestate", "a=b")])
    seen = dict(rec.requests[-1][0])
    assert seen["traceparent"] == VALID_TRACEPARENT and seen["tracestate"] == "a=b"


def test_duplicate_headers_are_comma_joined_in_order(edge: tuple[Recorder, str]) -> None:
    rec, proxy = edge
    send(proxy, [("content-type", "application/json"), ("openai-beta", "a"), ("openai-beta", "b")])
    assert [v for k, v in rec.requests[-1][0] if k == "openai-beta"] == ["a, b"]


def test_a_json_route_without_content_type_reaches_the_upstream_as_json(edge: tuple[Recorder, str]) -> None:
    rec, proxy = edge
    status, _ = send(proxy, [])
    assert status == 200
    assert dict(rec.requests[-1][0])["content-type"] == "application/json"


# -- item 10: what reaches the client ----------------------------------------------------------
def test_upstream_credentials_cookies_and_hsts_stay_upstream(edge: tuple[Recorder, str]) -> None:
    rec, proxy = edge
    rec.answer = [
        (b"authorization", b"Bearer upstream-secret"),
        (b"set-cookie", b"session=1"),
        (b"www-authenticate", b"Bearer realm=x"),
        (b"strict-transport-security", b"max-age=31536000"),
        (b"connection", b"x-upstream-extra"),
        (b"x-upstream-extra", b"hop"),
        (b"x-ratelimit-remaining-requests", b"99"),
        (b"openai-processing-ms", b"12"),
        (b"retry-after", b"3"),
        (b"x-request-id", b"upstream-id"),
    ]
    try:
        status, got = send(proxy, [("content-type", "application/json")])
    finally:
        rec.answer = []
    assert status == 200
    names = {k for k, _ in got}
    for name in (
        "authorization",
        "set-cookie",
        "www-authenticate",
        "strict-transport-security",
        "x-upstream-extra",
    ):
        assert name not in names, f"the upstream's {name} reached the client"
    d = dict(got)
    assert d["x-ratelimit-remaining-requests"] == "99" and d["openai-processing-ms"] == "12"
    assert d["retry-after"] == "3" and d["x-request-id"] != "upstream-id"


# -- randomized: both policies, over arbitrary names, values and duplicates -------------------
_token = st.from_regex(r"[a-z][a-z0-9-]{0,24}", fullmatch=True)
_value = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
# uvicorn and http.client own these (framing, the connection): not a policy's business.
_EDGE = {"content-length", "transfer-encoding", "host", "expect", "connection", "upgrade", "te", "trailer"}
_request_names = st.one_of(
    st.sampled_from(
        sorted(FORWARDED)
        + ["x-stainless-lang", "x-stainless-retry-count", "x-allowed-a", "x-request-id", "x-forwarded-for"]
        + BILLING_AND_ROUTING
        + CREDENTIALS
        + ["keep-alive", "proxy-connection", "accept-encoding", "x-custom", "x-api-key-2"]
    ),
    _token,
).filter(lambda n: n not in _EDGE)
_traceparent = st.one_of(st.just(VALID_TRACEPARENT), _value)


def _forwarded(name: str) -> bool:
    return name in FORWARDED or name.startswith(FORWARDED_PREFIXES)


def _valid_traceparent(v: str) -> bool:
    parts = v.split("-")
    hexes = all(c in "0123456789abcdef" for c in "".join(parts[:4]))
    return (
        len(v) == 55
        and [len(p) for p in parts] == [2, 32, 16, 2]
        and hexes
        and parts[0] == "00"
        and set(parts[1]) != {"0"}
        and set(parts[2]) != {"0"}
    )


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    headers=st.lists(st.tuples(_request_names, _value), max_size=12),
    trace=st.lists(_traceparent, max_size=2),
    query=st.lists(
        st.tuples(st.sampled_from(["api_key", "key", "x", "limit", "my-token"]), _value), max_size=3
    ),
)
def test_what_reaches_the_upstream_is_exactly_the_allowed_set(
    edge: tuple[Recorder, str], headers: list[tuple[str, str]], trace: list[str], query: list[tuple[str, str]]
) -> None:
    rec, proxy = edge
    sent = headers + [("traceparent", t) for t in trace]
    q = "&".join(f"{k}={v.replace('&', '').replace('#', '').replace('%', '')}" for k, v in query)
    status, got = send(proxy, sent, "/v1/chat/completions" + ("?" + q if q else ""))
    assert status == 200, (status, sent)
    upstream, upstream_query = rec.requests[-1]
    seen = dict(upstream)
    assert len(seen) == len(upstream), f"a header reached the upstream twice: {upstream}"
    want = {k: v for k, v in joined(sent).items() if _forwarded(k)}
    if "traceparent" in want and not _valid_traceparent(want["traceparent"]):
        del want["traceparent"]
    if "traceparent" not in want:
        want.pop("tracestate", None)
    want.setdefault("content-type", "application/json")
    theirs = {k: v for k, v in seen.items() if k not in OWN_REQUEST and k != "accept"}
    want.pop("accept", None)
    assert theirs == want
    if "accept" in joined(sent):
        assert seen["accept"] == joined(sent)["accept"]
    assert seen["authorization"] == f"Bearer {SECRET}"
    assert seen["x-request-id"] == dict(got)["x-request-id"]
    assert seen["x-forwarded-for"].endswith("127.0.0.1")
    for k in [p.split("=", 1)[0] for p in upstream_query.split("&") if p]:
        assert k in ("x", "limit"), f"the query's {k} reached the upstream"


_response_names = st.one_of(
    st.sampled_from(
        sorted(RETURNED - {"content-type"})
        + ["x-ratelimit-limit-tokens", "x-ratelimit-reset-requests", "openai-organization", "openai-project"]
        + [
            "authorization",
            "set-cookie",
            "www-authenticate",
            "strict-transport-security",
            "proxy-authenticate",
        ]
        + ["x-request-id", "keep-alive", "server", "date", "x-powered-by", "location", "alt-svc", "vary"]
    ),
    _token,
).filter(lambda n: n not in _EDGE and n != "content-type")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    answer=st.lists(st.tuples(_response_names, _value), max_size=12),
    hop=st.lists(_response_names, max_size=2),
)
def test_what_reaches_the_client_is_exactly_the_allowed_set(
    edge: tuple[Recorder, str], answer: list[tuple[str, str]], hop: list[str]
) -> None:
    rec, proxy = edge
    rec.answer = [(k.encode(), v.encode()) for k, v in answer]
    if hop:
        rec.answer.append((b"connection", ", ".join(hop).encode()))
    try:
        status, got = send(proxy, [("content-type", "application/json")])
    finally:
        rec.answer = []
    assert status == 200
    want: list[Any] = [
        (k, v) for k, v in answer if (k in RETURNED or k.startswith(RETURNED_PREFIXES)) and k not in hop
    ]
    theirs = [(k, v) for k, v in got if k not in OWN_RESPONSE and k != "content-type"]
    assert sorted(theirs) == sorted(want)
    assert [v for k, v in got if k == "content-type"] == ["application/json"]


def test_a_fallback_gets_the_headers_its_own_policy_allows() -> None:
    """The routed upstream's policy filters the headers at intake; a fallback with a wider one
    still gets what it allows (and one with a narrower one would not get more)."""
    rec = Recorder()
    with serve_in_thread(rec) as url:
        dead = UpstreamSettings(name="dead", base_url="http://127.0.0.1:9/v1", fallback=["wide"])
        wide = UpstreamSettings(name="wide", base_url=url + "/v1", forward_headers=["openai-project"])
        s = Settings(upstreams=[dead, wide])
        s.retry.max_attempts = 1
        with run_proxy(s) as proxy:
            status, _ = send(proxy, [("openai-project", "p-1"), ("x-forwarded-host", "evil")])
    assert status == 200
    seen = dict(rec.requests[-1][0])
    assert seen["openai-project"] == "p-1" and "x-forwarded-host" not in seen
    assert seen["content-type"] == "application/json"


# -- the request side's function itself: what uvicorn leaves to it (Connection, X-Forwarded-For) --
_latin1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters=","), max_size=20)
_raw_names = st.one_of(
    st.sampled_from(["connection", "x-forwarded-for", "traceparent", "tracestate", "x-stainless-os"]),
    _request_names,
)


@settings(max_examples=EXAMPLES * 5, deadline=None)
@given(
    headers=st.lists(st.tuples(_raw_names, st.one_of(_latin1, _traceparent)), max_size=12),
    hop=st.lists(st.sampled_from(["x-forwarded-for", "accept", "x-stainless-os", "Tracestate", " baggage "])),
)
def test_forwarded_headers_keep_the_allowed_set_in_order(
    headers: list[tuple[str, str]], hop: list[str]
) -> None:
    """Joined duplicates in first-arrival order, what `Connection` names dropped (X-Forwarded-For
    included: then only the client's address is sent), a malformed traceparent dropped with its
    tracestate, non-ASCII bytes kept as latin-1, X-Forwarded-For last."""
    if hop:
        headers = [*headers, ("connection", ", ".join(hop))]
    policy = request_policy(["openai-organization", "x-allowed-*"])
    raw = [(k.encode(), v.encode("latin-1")) for k, v in headers]
    got = forwarded_headers(raw, ("10.0.0.7", 5000), policy)
    named = {t.strip().lower() for k, v in headers if k == "connection" for t in v.split(",")}
    want: dict[str, str] = {}
    for k, v in headers:
        if _forwarded(k) and k not in named:
            want[k] = v if k not in want else want[k] + ", " + v
    if "traceparent" in want and not _valid_traceparent(want["traceparent"]):
        del want["traceparent"]
    if "traceparent" not in want:
        want.pop("tracestate", None)
    sent_for = [] if "x-forwarded-for" in named else [v for k, v in headers if k == "x-forwarded-for"]
    want["x-forwarded-for"] = ", ".join([*sent_for, "10.0.0.7"])
    assert list(got.items()) == list(want.items())
