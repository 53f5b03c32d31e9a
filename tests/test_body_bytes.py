"""The body goes upstream as the client sent it (issue 24, item 6).

The one change infertap makes to a body, asking a stream for usage, is spliced into the client's
bytes; it used to re-serialize the whole body with orjson, which wrote an integer over 64 bits as a
float (`1180591620717411303424` -> `1.1805916207174113e+21`) and failed with a 500 beyond 255 levels
of nesting. Hypothesis writes JSON bodies (deep nesting, big integers, floats, unicode and escapes,
any key order and whitespace, every shape of `stream_options`) byte by byte and checks what the
upstream received against the client's bytes plus the splice. INFERTAP_BODY_EXAMPLES=1000 runs it
long (CI: 30 examples, a few seconds).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import make_settings, run_proxy, serve_in_thread

INJECTED = b'"stream_options":{"include_usage":true},'


@pytest.fixture(scope="module")
def proxied() -> Iterator[tuple[FakeUpstream, str]]:
    upstream = FakeUpstream()
    with serve_in_thread(upstream) as url, run_proxy(make_settings(("fake", url + "/v1"))) as proxy:
        yield upstream, proxy


def _post(proxy: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json", "x-fake-events": "2"}
    return httpx.post(proxy + "/v1/chat/completions", content=body, headers=headers, timeout=30)


MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    "body",
    [
        # Before: upstream read "seed":1.1805916207174113e+21 (and "x":1.1).
        f'{{"model": "fake-model", "stream": true, "seed": 1180591620717411303424, "x": 1.10, {MESSAGES}}}',
        # Before: 500 (orjson writes 255 levels at most, reads 1,024).
        f'{{"model": "fake-model", "stream": true, {MESSAGES}, "deep": {"[" * 300}1{"]" * 300}}}',
    ],
    ids=["big-integer", "deep-nesting"],
)
def test_a_big_integer_and_deep_nesting_reach_the_upstream_as_sent(
    proxied: tuple[FakeUpstream, str], body: str
) -> None:
    upstream, proxy = proxied
    r = _post(proxy, body.encode())
    assert r.status_code == 200, r.text
    assert upstream.requests[-1].body == b"{" + INJECTED + body.encode()[1:]


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "fake-model", "stream": true, "x": 1e400}',  # orjson reads no infinity
        b'{"model": "fake-model", "stream": true, "x": ' + b"[" * 1100 + b"]" * 1100 + b"}",
    ],
)
def test_a_body_infertap_cannot_read_gets_400_not_500(proxied: tuple[FakeUpstream, str], body: bytes) -> None:
    upstream, proxy = proxied
    before = len(upstream.requests)
    r = _post(proxy, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert len(upstream.requests) == before


# -- any JSON body, byte for byte ----------------------------------------------------------------

TRICKY = ["stream_options", '"stream_options":null', "{", "}", "[", "\\", '"', "é 🚀 \u2028", "\x00\x1f"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(TRICKY),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(TRICKY), st.text(max_size=6)), inner, max_size=4),
    ),
    max_leaves=12,
)
# What the client says about usage: nothing, null, or an object with or without include_usage.
OPTIONS = [None, "null", "{}", '{"continuous_usage_stats":true}', '{"include_usage":false}']


class Writer:
    """JSON as a client might write it: its whitespace, its escapes, its number spelling."""

    def __init__(self, ws: str, ascii_only: bool) -> None:
        self.ws = ws
        self.ascii_only = ascii_only

    def string(self, s: str) -> str:
        return json.dumps(s, ensure_ascii=self.ascii_only)

    def value(self, v: Any) -> str:
        w = self.ws
        if isinstance(v, dict):
            inner = ("," + w).join(f"{self.string(k)}{w}:{w}{self.value(x)}" for k, x in v.items())
            return "{" + w + inner + w + "}"
        if isinstance(v, list):
            return "[" + w + ("," + w).join(self.value(x) for x in v) + w + "]"
        if isinstance(v, float):
            return repr(v)
        return json.dumps(v, ensure_ascii=self.ascii_only)  # big integers as their digits


@settings(
    max_examples=int(os.environ.get("INFERTAP_BODY_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    extra=st.dictionaries(
        st.text(max_size=6).filter(lambda k: k not in ("model", "stream", "stream_options")),
        values,
        max_size=4,
    ),
    depth=st.integers(0, 600),
    options=st.sampled_from(OPTIONS),
    escaped_key=st.booleans(),
    ws=st.sampled_from(["", " ", "\n  ", "\t", "\r\n"]),
    ascii_only=st.booleans(),
    order=st.randoms(use_true_random=False),
)
@example(
    extra={"seed": 2**70}, depth=300, options=None, escaped_key=False, ws="", ascii_only=True, order=None
)
def test_the_upstream_reads_the_clients_bytes_plus_the_splice(
    proxied: tuple[FakeUpstream, str],
    extra: dict[str, Any],
    depth: int,
    options: str | None,
    escaped_key: bool,
    ws: str,
    ascii_only: bool,
    order: Any,
) -> None:
    upstream, proxy = proxied
    w = Writer(ws, ascii_only)
    members = [f'"model"{ws}:{ws}"fake-model"', f'"stream"{ws}:{ws}true']
    members += [f"{w.string(k)}{ws}:{ws}{w.value(v)}" for k, v in extra.items()]
    members.append(f'"deep"{ws}:{ws}' + "[" * depth + "0" + "]" * depth)
    if options is not None:
        key = '"stream\\u005foptions"' if escaped_key else '"stream_options"'
        members.append(f"{key}{ws}:{ws}\x01{options}")  # \x01: where its value starts, for the oracle
    if order is not None:
        order.shuffle(members)
    text = ws + "{" + ws + ("," + ws).join(members) + ws + "}" + ws
    marked = text.encode()
    body = marked.replace(b"\x01", b"")
    r = _post(proxy, body)
    assert r.status_code == 200, r.text
    got = upstream.requests[-1].body
    # The oracle, written independently of infertap's splice: the one change, at its one place.
    if options is None:
        at = body.index(b"{") + 1
        expected = body[:at] + INJECTED + body[at:]
    else:
        at = marked.index(b"\x01")
        if options == "null":
            expected = body[:at] + b'{"include_usage":true}' + body[at + 4 :]
        elif options == "{}":
            expected = body[: at + 1] + b'"include_usage":true' + body[at + 1 :]
        elif "include_usage" in options:
            expected = body  # the client decided
        else:
            expected = body[: at + 1] + b'"include_usage":true,' + body[at + 1 :]
    assert got == expected
    if options != '{"include_usage":false}':
        assert orjson.loads(got)["stream_options"]["include_usage"] is True
