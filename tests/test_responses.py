"""The Responses API (POST /v1/responses): measured like chat, relayed unchanged, served by the sim."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.core.exchange import Exchange, Outcome
from proxy.core.forward.intake import prompt_chars
from proxy.core.sse import ResponsesScanner, SSEScanner
from proxy.observe.tracing import TracingObserver
from proxy.observe.tracing.genai_content import Budget, input_messages
from proxy.settings import TracingSettings
from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig
from proxy.sim.protocol import ResponsesRequest
from proxy.sim.responses import ResponsesFormat
from tests.conftest import RecordingObserver, make_settings, run_proxy, serve_in_thread

USAGE = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
WORDS = ["Hello", " there", ",", " friend", "."]


def answer(reason: str = "stop", words: list[str] = WORDS) -> tuple[ResponsesFormat, bytes]:
    fmt = ResponsesFormat("sim-model", ResponsesRequest(input="hi"))
    body = fmt.first() + b"".join(fmt.token(w) for w in words)
    return fmt, body + fmt.end(reason, {**USAGE, "completion_tokens": len(words)})


def scan(scanner: SSEScanner, data: bytes, piece: int) -> tuple[bytes, int]:
    out, outputs = bytearray(), 0
    for i in range(0, len(data), piece):
        chunk, n = scanner.feed(data[i : i + piece])
        out += chunk
        outputs += n
    return bytes(out) + scanner.flush(), outputs


# -- the scanner -------------------------------------------------------------------------------


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000])
def test_scanner_counts_the_deltas_and_reads_the_end(piece: int) -> None:
    fmt, data = answer()
    scanner = ResponsesScanner()
    out, outputs = scan(scanner, data, piece)
    facts = scanner.facts
    assert out == data  # unchanged
    # Only the deltas are output: not the .done events and response.completed that repeat the text.
    assert outputs == len(WORDS)
    assert facts.done and facts.error_events == 0
    assert facts.usage is not None and facts.usage["output_tokens"] == 5 and facts.usage["input_tokens"] == 9
    assert facts.finish_reasons == ["stop"]
    assert facts.response_id == fmt.id and facts.response_model == "sim-model"


def test_scanner_incomplete_failed_and_error_events() -> None:
    scanner = ResponsesScanner()
    scan(scanner, answer("length")[1], 50)
    assert scanner.facts.done and scanner.facts.finish_reasons == ["max_output_tokens"]

    failed = {
        "type": "response.failed",
        "response": {"id": "resp_1", "status": "failed", "error": {"code": "x"}},
    }
    scanner = ResponsesScanner()
    scan(scanner, b"event: response.failed\ndata: " + json.dumps(failed).encode() + b"\n\n", 9)
    assert scanner.facts.error_events == 1 and not scanner.facts.done

    scanner = ResponsesScanner()
    scan(scanner, b'data: {"type":"error","code":"server_error","message":"boom"}\n\n', 9)
    assert scanner.facts.error_events == 1


def test_scanner_captures_the_output_text_for_loop_detection() -> None:
    scanner = ResponsesScanner(capture_chars=12)
    scan(scanner, answer()[1], 33)
    assert "".join(scanner.facts.text) == "".join(WORDS)[:12]


# -- through infertap --------------------------------------------------------------------------


class ResponsesUpstream:
    """Serves one scripted Responses stream per request and records what it got and sent.

    x-test-cut: 1        end the stream after the deltas, without response.completed
    x-test-wait-ms: W    pause W ms after the opening events, before the first delta
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.sent = bytearray()
        self.app = Starlette(routes=[Route("/v1/responses", self.respond, methods=["POST"])])

    async def respond(self, request: Request) -> Response:
        body = await request.body()
        self.bodies.append(json.loads(body))
        fmt = ResponsesFormat("sim-model", ResponsesRequest.model_validate_json(body))
        wait = int(request.headers.get("x-test-wait-ms", "0")) / 1000
        cut = request.headers.get("x-test-cut") == "1"

        def sent(data: bytes) -> bytes:
            self.sent.extend(data)
            return data

        async def events() -> AsyncIterator[bytes]:
            yield sent(fmt.first())
            await asyncio.sleep(wait)
            for w in WORDS:
                yield sent(fmt.token(w))
            if not cut:
                yield sent(fmt.end("stop", {**USAGE, "completion_tokens": len(WORDS)}))

        return StreamingResponse(events(), media_type="text/event-stream")


@contextmanager
def proxied(app: Any) -> Iterator[tuple[str, RecordingObserver]]:
    rec = RecordingObserver()
    with serve_in_thread(app) as up, run_proxy(make_settings(("up", up + "/v1")), rec) as url:
        yield url, rec


def only(rec: RecordingObserver) -> Exchange:
    rids = {rid for _, rid in rec.events}
    assert len(rids) == 1
    return rec.wait_terminal(rids.pop())


def test_openai_sdk_stream_through_infertap_to_the_sim() -> None:
    with proxied(create_sim_app(SimConfig())) as (url, rec):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            events = list(
                client.responses.create(
                    model="sim-model",
                    input=[{"role": "user", "content": "Say hello"}],
                    instructions="Be brief.",
                    stream=True,
                    extra_headers={"x-sim-output-tokens": "6"},
                )
            )
        ex = only(rec)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 6
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens == 6
    assert ex.route == "responses" and ex.outcome is Outcome.OK and ex.stream
    assert ex.output_events == 6 and ex.completion_tokens == 6
    assert ex.prompt_tokens == final.usage.input_tokens
    assert ex.first_token_at is not None and ex.ttft is not None and ex.tpot is not None
    assert ex.finish_reasons == ["stop"] and ex.response_id == final.id


def test_openai_sdk_whole_response_through_infertap_to_the_sim() -> None:
    with proxied(create_sim_app(SimConfig())) as (url, rec):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            response = client.responses.create(model="sim-model", input="Say hello", max_output_tokens=4)
        ex = only(rec)
    assert response.status == "incomplete" and response.usage is not None
    assert response.usage.output_tokens == 4 and len(response.output_text) > 0
    assert ex.route == "responses" and not ex.stream and ex.outcome is Outcome.OK
    assert ex.completion_tokens == 4 and ex.first_token_at is None
    assert ex.finish_reasons == ["max_output_tokens"] and ex.params == {"max_output_tokens": 4}


def test_a_traced_responses_request_is_a_chat_span_with_its_token_limit() -> None:
    exporter = InMemorySpanExporter()
    observer = TracingObserver(TracingSettings(), processor=SimpleSpanProcessor(exporter))
    rec = RecordingObserver()
    with serve_in_thread(create_sim_app(SimConfig())) as up:
        with run_proxy(make_settings(("up", up + "/v1")), observer, rec) as url:
            body = {"model": "sim-model", "input": "hi", "stream": True, "max_output_tokens": 3}
            with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
                r.read()
            only(rec)
    server = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    attrs = dict(server.attributes or {})
    assert server.name == "chat sim-model" and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 3 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ("max_output_tokens",)


def test_bytes_pass_unchanged_and_no_stream_options_is_added() -> None:
    upstream = ResponsesUpstream()
    with proxied(upstream.app) as (url, rec):
        body = {"model": "m", "input": "hi", "stream": True}
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
            got = r.read()
        ex = only(rec)
    assert r.status_code == 200 and r.headers["x-accel-buffering"] == "no"
    assert got == bytes(upstream.sent)
    assert upstream.bodies == [body]  # the Responses API has no stream_options: usage always comes
    assert ex.outcome is Outcome.OK and ex.completion_tokens == len(WORDS) and ex.prompt_tokens == 9


def test_ttft_waits_for_the_first_delta_not_the_opening_events() -> None:
    with proxied(ResponsesUpstream().app) as (url, rec):
        body = {"model": "m", "input": "hi", "stream": True}
        headers = {"x-test-wait-ms": "300"}
        with httpx.stream("POST", url + "/v1/responses", json=body, headers=headers, timeout=30) as r:
            r.read()
        ex = only(rec)
    # response.created and friends arrived at once; the first token only after the pause.
    assert ex.ttft is not None and ex.ttft >= 0.3
    assert ex.first_byte_at is not None and ex.first_token_at is not None
    assert ex.first_token_at - ex.first_byte_at >= 0.3


def test_a_stream_without_response_completed_is_interrupted() -> None:
    with proxied(ResponsesUpstream().app) as (url, rec):
        body = {"model": "m", "input": "hi", "stream": True}
        with httpx.stream("POST", url + "/v1/responses", json=body, headers={"x-test-cut": "1"}) as r:
            got = r.read()
        ex = only(rec)
    last = got.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert b"without response.completed" in last and b'"error"' in last
    assert ex.outcome is Outcome.STREAM_INTERRUPTED and ex.output_events == len(WORDS)


def test_bad_input_gets_an_openai_error() -> None:
    with proxied(create_sim_app(SimConfig())) as (url, _):
        r = httpx.post(url + "/v1/responses", content=b"{not json", timeout=30)
        missing = httpx.post(url + "/v1/responses", json={"input": "hi"}, timeout=30)
        sim = httpx.post(url + "/v1/responses", json={"model": "m", "input": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    assert sim.status_code == 400 and sim.json()["error"]["param"] == "input"


def test_prompt_size_and_captured_input_read_the_responses_fields() -> None:
    request = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Hello"},
            {"role": "user", "content": [{"type": "input_text", "text": "there"}, {"type": "input_image"}]},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
    }
    assert prompt_chars(request) == len("Be brief.") + len("Hello") + len("there")
    assert prompt_chars({"model": "m", "input": "Hello"}) == 5
    assert input_messages("responses", request, Budget(100)) == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {"role": "user", "parts": [{"type": "text", "content": "Hello"}]},
        {"role": "user", "parts": [{"type": "text", "content": "there"}, {"type": "input_image"}]},
    ]
