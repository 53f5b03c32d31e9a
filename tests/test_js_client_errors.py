"""What the JavaScript clients (see tests/test_js_clients.py) show when an upstream fails: the
in-band error events infertap ends a committed stream with (chat's `data: {"error": ...}`, the
Responses API's `error` + `response.failed`), in infertap's own words, on an event boundary, and an
engine's vLLM-style error body in OpenAI's shape (issue 23, items 3-6 and 17).

A small engine here fails on purpose, by the request's model name: it cuts its stream in the
middle of an event, goes silent mid-stream, or refuses with vLLM's error body. One
`python -m proxy serve` in front of it, with a short idle timeout and no retries, serves the module.
After each scenario, infertap's `infertap_requests_total` moved by exactly the requests the script
made, with the outcome their failure must have.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from proxy.core.asgi import Receive, Scope, Send
from proxy.sim.protocol import ResponsesRequest
from proxy.sim.responses import ResponsesFormat
from tests.conftest import serve_in_thread, serve_process
from tests.test_js_clients import CLIENTS, PROMPT, Metrics, find_node, run_js

UPSTREAM = "errs"  # infertap's name for the engine below: every message must name it
IDLE_S = 1  # infertap's idle timeout: how long the silent stream waits before it fails
CUT = "cut-mid-event"  # model names: what the engine does
SILENT = "silent-mid-stream"
VLLM_ERROR = "vllm-error"
WORDS = ["Prefill", " reads", " the", " prompt", " at", " once"]
SENT = 3  # output events a failing stream delivers before it fails
VLLM_MESSAGE = "max_tokens must be at least 1, got 0."
# A class name in a message ("SocketTimeoutError", "ClientPayloadError", "TimeoutException") or
# the HTTP library's: words of a library that mean nothing to a client (issue 23, item 4).
LIBRARY_WORDS = re.compile(r"[A-Z][a-z]+[A-Za-z]*(Error|Exception|Timeout)\b|aiohttp|asyncio|socket")


def _chat_event(model: str, delta: dict[str, Any]) -> bytes:
    obj = {
        "id": "chatcmpl-errs",
        "object": "chat.completion.chunk",
        "created": 1733300000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _events(path: str, model: str) -> tuple[bytes, list[bytes]]:
    """A stream's opening (before any output), then one event per word."""
    if path.endswith("/responses"):
        fmt = ResponsesFormat(model, ResponsesRequest(model=model, input=PROMPT))
        return fmt.first(), [fmt.token(w) for w in WORDS]
    return _chat_event(model, {"role": "assistant", "content": ""}), [
        _chat_event(model, {"content": w}) for w in WORDS
    ]


async def _json(send: Send, status: int, body: Any) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": orjson.dumps(body)})


async def failing_engine(scope: Scope, receive: Receive, send: Send) -> None:
    """An OpenAI-compatible engine that fails as its request's model name says."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["path"].endswith("/models"):  # infertap's background check
        await _json(send, 200, {"object": "list", "data": [{"id": CUT, "object": "model"}]})
        return
    model = json.loads(body)["model"]
    if model == VLLM_ERROR:
        # vLLM's own error body: no `error` key, the message at the top level.
        error = {"object": "error", "message": VLLM_MESSAGE, "type": "BadRequestError", "param": None}
        await _json(send, 400, {**error, "code": 400})
        return
    opening, output = _events(scope["path"], model)
    headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for event in [opening, *output[:SENT]]:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    if model == CUT:
        half = output[SENT][: len(output[SENT]) // 2]
        await send({"type": "http.response.body", "body": half, "more_body": True})
        raise ConnectionAbortedError("the engine cuts its stream mid-event")  # uvicorn drops the connection
    assert model == SILENT, model
    await receive()  # nothing more, until infertap gives up and leaves


@pytest.fixture(scope="module")
def node() -> str:
    return find_node()


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with serve_in_thread(failing_engine) as url:
        yield url + "/v1"


@pytest.fixture(scope="module")
def infertap(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_"))}
    env |= {
        "INFERTAP_SERVER__DRAIN_DELAY": "0",
        "INFERTAP_TIMEOUTS__IDLE": str(IDLE_S),
        "INFERTAP_RETRY__MAX_ATTEMPTS": "1",
        "INFERTAP_CIRCUIT__MIN_CALLS": "1000000",  # every request here fails on purpose
    }
    log = tmp_path_factory.mktemp("serve-errs") / "serve.log"
    with serve_process("--upstream", f"{UPSTREAM}={engine}", env=env, log=log) as (base, _):
        yield base


def in_infertaps_words(message: str, engine: str) -> None:
    assert f"upstream '{UPSTREAM}' ({engine})" in message, message
    assert not LIBRARY_WORDS.search(message), message


clients = pytest.mark.parametrize("client", list(CLIENTS))
routes = pytest.mark.parametrize("route", ["chat.completions", "responses"])


@clients
@routes
@pytest.mark.parametrize(
    ("model", "outcome", "said"),
    [
        (CUT, "stream_interrupted", "closed the connection mid-response"),
        (SILENT, "idle_timeout", f"sent nothing for {IDLE_S} s mid-response (idle timeout)"),
    ],
    ids=["cut-mid-event", "silent"],
)
def test_a_stream_that_fails_midway_throws_infertaps_message(
    node: str, infertap: str, engine: str, client: str, route: str, model: str, outcome: str, said: str
) -> None:
    """The client saw the first words, then an error carrying infertap's message: no JSON parse
    error from a half event, no AI_TypeValidationError from a shape the Responses API lacks."""
    count = Metrics(infertap)
    api = route.removesuffix(".completions")
    r = run_js(node, client, "stream_failure", infertap, prompt=PROMPT, model=model, route=api)
    assert r["text"] == "".join(WORDS[:SENT]) and r["deltas"] == SENT
    (error,) = r["errors"]  # exactly one error, however many events told it
    assert said in error["message"], error
    in_infertaps_words(error["message"], engine)
    assert "TypeValidation" not in error["name"] + error["message"], error
    assert "JSON" not in error["message"], error
    if client == "ai-sdk":
        assert r["finishReason"] == "error"
    moved = count.settle(r["requests"])
    assert moved.requests == {(route, "true", outcome): 1}
    assert moved.ttft == 1  # the first words did reach the client


@clients
def test_an_engines_vllm_error_body_shows_its_message(node: str, infertap: str, client: str) -> None:
    """A 400 with vLLM's body (no `error` key): each client's error carries the engine's message,
    not "400 status code (no body)", streamed or not, on both APIs."""
    count = Metrics(infertap)
    r = run_js(node, client, "upstream_error", infertap, prompt=PROMPT, model=VLLM_ERROR)
    assert r["errors"] and len(r["errors"]) == r["requests"]
    for key, error in r["errors"].items():
        assert error is not None, f"{key}: no error thrown"
        assert VLLM_MESSAGE in error["message"], (key, error)
        assert error["status"] == 400, (key, error)
    moved = count.settle(r["requests"])
    expected = Counter((*key.split("/"), "client_error") for key in r["errors"])
    assert moved.requests == dict(expected) and moved.ttft == 0
