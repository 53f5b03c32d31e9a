"""Asking for usage leaves no trace in what the client reads (issue 23, item 7).

When the client did not ask for usage, infertap adds `stream_options.include_usage` to its request.
OpenAI and vLLM then write `"usage":null` on every other chunk, and a usage-only chunk before
`[DONE]`: infertap removes both, so the client's raw bytes are those of a direct connection with its
own request. SGLang writes `"usage":null` whether asked or not: there nothing is removed.

A fake upstream serves one stream in each engine's serialization, with or without usage as the
request says; hypothesis picks the text (quotes, escapes, `"usage":null` inside it, unicode) and the
sizes of the pieces the upstream writes. INFERTAP_USAGE_EXAMPLES=2000 runs both long (CI: 25
examples end to end, 200 at the scanner; a few seconds).
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

from proxy.core.sse import SSEScanner
from tests.conftest import make_settings, run_proxy, serve_in_thread

USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
ENGINES = ("openai", "vllm", "sglang", "spaced")


def _dump(engine: str, obj: dict[str, Any]) -> bytes:
    if engine == "spaced":  # a Python server writing json.dumps' defaults: `"usage": null`, \u escapes
        return json.dumps(obj).encode()
    if engine == "openai":
        return orjson.dumps(obj)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()  # pydantic's JSON


def _choice(engine: str, chat: bool, role: bool, text: str | None, finish: str | None) -> dict[str, Any]:
    if not chat:
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    elif engine == "sglang":  # every field of its pydantic models, null or not
        delta = {"role": "assistant" if role else None, "content": "" if role else text}
        delta |= {"reasoning_content": None, "tool_calls": None}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            d["content"] = text
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
    if engine == "sglang":
        choice["matched_stop"] = None
    return choice


def render(engine: str, chat: bool, words: list[str], include_usage: bool) -> bytes:
    """The whole stream `engine` sends for `words`, asked for usage or not."""
    head: dict[str, Any] = {"id": "chatcmpl-7Qx2" if chat else "cmpl-7Qx2"}
    head |= {"object": "chat.completion.chunk" if chat else "text_completion", "created": 1733300000}
    head["model"] = "m"
    if engine == "openai":
        head |= {"service_tier": "default", "system_fingerprint": "fp_0ba0d124f1"}

    def event(choices: list[dict[str, Any]], first: bool = False, usage: Any = None) -> bytes:
        obj = {**head, "choices": choices}
        if engine == "sglang":
            obj["usage"] = usage  # its model's default, written unasked
        elif include_usage and not (engine == "vllm" and first):  # vLLM leaves it off the role chunk
            obj["usage"] = usage
        if engine == "openai":
            obj["obfuscation"] = "pZ3x"  # after `usage`: the removal works mid-object too
        return b"data: " + _dump(engine, obj) + b"\n\n"

    out = [event([_choice(engine, chat, True, None, None)], first=True)] if chat else []
    out += [event([_choice(engine, chat, False, w, None)]) for w in words]
    out.append(event([_choice(engine, chat, False, None, "stop")]))
    if include_usage:
        out.append(event([], usage=USAGE))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


class EngineUpstream:
    """An ASGI upstream that streams `x_words` (a field of the request body) as `x-test-engine` would,
    in pieces of `x-test-piece` bytes; it remembers whether each request asked for usage."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if scope["method"] != "POST" or "x-test-engine" not in headers:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        req = json.loads(body)
        asked = bool((req.get("stream_options") or {}).get("include_usage"))
        self.asked.append(asked)
        chat = scope["path"].endswith("/chat/completions")
        stream = render(headers["x-test-engine"], chat, req["x_words"], asked)
        ctype = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": ctype})
        piece = int(headers["x-test-piece"])
        for i in range(0, len(stream), piece):
            await send({"type": "http.response.body", "body": stream[i : i + piece], "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[EngineUpstream, str, str]]:
    upstream = EngineUpstream()
    with serve_in_thread(upstream) as url:
        with run_proxy(make_settings(("engine", url + "/v1"))) as proxy:
            yield upstream, url, proxy


TRICKY = ['"usage":null', ',"usage":null}', '{"usage": null, ', 'x\\"usage', "usage", "\\", "é 🚀 \u2028"]
words_st = st.lists(
    st.one_of(st.sampled_from(TRICKY), st.text(min_size=1, max_size=12)), min_size=1, max_size=6
)


def _post(base: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    with httpx.stream("POST", base + path, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return r.read()


@settings(
    max_examples=int(os.environ.get("INFERTAP_USAGE_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    name=st.sampled_from(ENGINES),
    chat=st.booleans(),
    words=words_st,
    piece=st.integers(1, 300),
    client_asks=st.sampled_from([None, False, True]),
)
@example(name="vllm", chat=True, words=["Hi", ' "usage":null'], piece=7, client_asks=None)
@example(name="openai", chat=True, words=["Hi"], piece=300, client_asks=None)
@example(name="sglang", chat=True, words=["Hi"], piece=300, client_asks=None)
@example(name="spaced", chat=False, words=["Hi"], piece=300, client_asks=None)
def test_the_client_reads_the_bytes_of_a_direct_connection(
    engine: tuple[EngineUpstream, str, str],
    name: str,
    chat: bool,
    words: list[str],
    piece: int,
    client_asks: bool | None,
) -> None:
    upstream, direct, proxy = engine
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m", "stream": True, "x_words": words}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    if client_asks is not None:
        body["stream_options"] = {"include_usage": client_asks}
    headers = {"x-test-engine": name, "x-test-piece": str(piece)}
    expected = _post(direct, path, body, headers)
    upstream.asked.clear()
    got = _post(proxy, path, body, headers)
    assert upstream.asked == [client_asks is not False]  # infertap asked when the client had not said
    assert got == expected


# -- the scanner alone: many more examples, every split ------------------------------------------


@settings(max_examples=int(os.environ.get("INFERTAP_USAGE_EXAMPLES", "200")), deadline=None)
@given(name=st.sampled_from(ENGINES), chat=st.booleans(), words=words_st, data=st.data())
def test_the_scanner_removes_exactly_what_asking_added(
    name: str, chat: bool, words: list[str], data: st.DataObject
) -> None:
    asked = render(name, chat, words, include_usage=True)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(asked) - 1), max_size=8)))
    pieces = [asked[a:b] for a, b in zip([0, *cuts], [*cuts, len(asked)], strict=True)]
    scanner = SSEScanner(strip_usage_only=True)
    out = b"".join(scanner.feed(p)[0] for p in pieces) + scanner.flush()
    assert out == render(name, chat, words, include_usage=False)
    assert scanner.facts.usage == USAGE and scanner.facts.done
    untouched = SSEScanner()
    assert b"".join(untouched.feed(p)[0] for p in pieces) == asked  # not injected: nothing touched


@pytest.mark.parametrize(
    ("event", "bare"),
    [
        (b'{"id":"a","usage":null}', b'{"id":"a"}'),
        (b'{"id":"a", "usage": null}', b'{"id":"a"}'),
        (b'{"id":"a","usage":null,"o":"x"}', b'{"id":"a","o":"x"}'),
        (b'{"usage":null,"id":"a"}', b'{"id":"a"}'),
        (b'{"usage": null, "id": "a"}', b'{"id": "a"}'),
        (b'{"usage":null}', b"{}"),
        (b'{"id":"a","usage":nullx}', b'{"id":"a","usage":nullx}'),  # not JSON: left as it is
        (b'{"c":"x\\"usage\\":null","usage":null}', b'{"c":"x\\"usage\\":null"}'),
        (b'{"id":"a","usage":null,"c":"x\\"usage"}', b'{"id":"a","c":"x\\"usage"}'),
        (b'{"id":"a","usage":{"total_tokens":1}}', b'{"id":"a","usage":{"total_tokens":1}}'),
    ],
)
def test_only_a_usage_member_is_cut(event: bytes, bare: bytes) -> None:
    out, _ = SSEScanner(strip_usage_only=True).feed(b"data: " + event + b"\n\n")
    assert out == b"data: " + bare + b"\n\n"
