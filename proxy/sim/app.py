"""The simulated engine's HTTP server: OpenAI's wire format over the Engine.

It serves the model names of its config (proxy/sim/models.py; others get 404 model_not_found
unless [sim] accept_any_model is set) and answers tool calls (proxy/sim/tools.py).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.core.asgi import watch_disconnect
from proxy.sim.admin import admin_routes
from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine
from proxy.sim.metrics import SimMetrics, cache_info
from proxy.sim.models import ServedModels
from proxy.sim.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
    build_spec,
    chat_prompt,
    completion_prompt,
    input_tokens,
    invalid,
    parse,
    responses_prompt,
    vllm_bad_request,
)
from proxy.sim.responses import ResponsesFormat
from proxy.sim.sampling import embedding
from proxy.sim.sequence import Finished, Sequence
from proxy.sim.tools import ToolCall, plan_tool_call, tool_call_choice, tool_call_message

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(e: ApiError) -> Response:
    return _json(e.body, e.status)


class WireFormat(Protocol):
    """How one answer is written: the stream's opening, each token, its end, or the whole body."""

    def first(self) -> bytes: ...
    def token(self, text: str) -> bytes: ...
    def end(self, reason: str, usage: dict[str, int]) -> bytes: ...
    def whole(self, text: str, reason: str, usage: dict[str, int]) -> dict[str, Any]: ...


class _Format:
    """Chunks and bodies of one response, chat or text completion."""

    def __init__(self, chat: bool, model: str, include_usage: bool, tool: ToolCall | None = None) -> None:
        self.chat = chat
        self.tool = tool
        self.tokens = 0
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created}
        body["model"] = self.model
        body["choices"] = choices
        if self.include_usage:  # as OpenAI: `usage: null` on every chunk but the usage one
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def first(self) -> bytes:
        # Chat streams open with a role-only delta at once, before any token, as vLLM and OpenAI do.
        return self._event([self._choice(None, None, role=True)]) if self.chat else b""

    def token(self, text: str) -> bytes:
        if self.tool is not None:
            self.tokens += 1  # the text is not used: the call's header, then its argument fragments
            return self._event([tool_call_choice(self.tool, self.tokens - 1)])
        return self._event([self._choice(text, None)])

    def end(self, reason: str, usage: dict[str, int]) -> bytes:
        if self.tool is not None and reason == "stop":
            reason = "tool_calls"
        out = self._event([self._choice(None, reason)])
        if self.include_usage:
            out += self._event([], usage)
        return out + b"data: [DONE]\n\n"

    def whole(self, text: str, reason: str, usage: dict[str, int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.tool is not None:
            choice["message"] = tool_call_message(self.tool)
            reason = "tool_calls" if reason == "stop" else reason
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": reason}
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage}  # fmt: skip


def _usage(seq: Sequence) -> dict[str, Any]:
    prompt = len(seq.spec.prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": seq.generated,
        "total_tokens": prompt + seq.generated,
        # As OpenAI and vLLM (--enable-prompt-tokens-details) report them: prefix cache hits.
        "prompt_tokens_details": {"cached_tokens": seq.cached},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


class _Api:
    def __init__(self, config: SimConfig, engine: Engine, metrics: SimMetrics) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.created = int(time.time())
        self.served = ServedModels(config, self.created)

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": self.served.cards()})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics_endpoint(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, "responses")

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            body = await request.body()
            req: ChatRequest | CompletionRequest | ResponsesRequest
            if kind == "chat":
                req = parse(ChatRequest, body)
                prompt = chat_prompt(req)
            elif kind == "completion":
                req = parse(CompletionRequest, body)
                prompt = completion_prompt(req)
            else:
                req = parse(ResponsesRequest, body)
                prompt = responses_prompt(req)
            model = self.served.check(req.model)
            tool = None
            if not isinstance(req, CompletionRequest):
                tool = plan_tool_call(req, prompt, self.config.sim.seed)
            spec = build_spec(self.config, req, prompt, request.headers, tool.tokens if tool else None)
        except ApiError as e:
            return _error(e)
        fmt: WireFormat
        if isinstance(req, ResponsesRequest):
            fmt = ResponsesFormat(model, req, tool)
        else:
            fmt = _Format(kind == "chat", model, req.include_usage, tool)
        seq = self.engine.submit(spec)
        if req.stream:
            return StreamingResponse(
                self._stream(seq, fmt), media_type="text/event-stream", headers=_STREAM_HEADERS
            )
        return await self._whole(request, seq, fmt)

    async def _stream(self, seq: Sequence, fmt: WireFormat) -> AsyncGenerator[bytes]:
        # Starlette cancels this generator when the client disconnects: `finally` frees the slot.
        try:
            first = fmt.first()
            if first:
                yield first
            while True:
                # Drain what is there into one write: a reader that fell behind catches up.
                items = [await seq.events.get()]
                while not seq.events.empty():
                    items.append(seq.events.get_nowait())
                out = b"".join(fmt.token(i) for i in items if isinstance(i, str))
                end = items[-1]
                if isinstance(end, Finished) and end.reason != "abort":
                    out += fmt.end(end.reason, _usage(seq))
                if out:
                    yield out
                if isinstance(end, Finished):
                    return
        finally:
            self.engine.abort(seq)

    async def _whole(self, request: Request, seq: Sequence, fmt: WireFormat) -> Response:
        def left() -> None:
            # A plain response never notices a disconnect by itself; without this the request
            # would hold its slot to the end.
            self.engine.abort(seq)
            seq.events.put_nowait(Finished("abort"))

        watcher = watch_disconnect(request.receive, left)
        try:
            parts: list[str] = []
            while not isinstance(item := await seq.events.get(), Finished):
                parts.append(item)
        finally:
            watcher.cancel()
            self.engine.abort(seq)
        return _json(fmt.whole("".join(parts), item.reason, _usage(seq)))

    async def embeddings(self, request: Request) -> Response:
        try:
            req = parse(EmbeddingRequest, await request.body())
            model = self.served.check(req.model)
            inputs = input_tokens(req.input)
            if not inputs:
                raise invalid("input: must not be empty", param="input")
            limit = self.config.model.max_model_len
            for tokens in inputs:
                if len(tokens) > limit:
                    raise vllm_bad_request(
                        f"This model's maximum context length is {limit} tokens. However, you requested "
                        f"{len(tokens)} tokens in the input for embedding generation. Please reduce the "
                        "length of the input."
                    )
        except ApiError as e:
            return _error(e)
        sim = self.config.sim
        total = sum(len(t) for t in inputs)
        # One prefill of all inputs, outside the scheduler: embeddings have no decode to batch with.
        await asyncio.sleep((sim.prefill_base_ms + sim.prefill_ms_per_token * total) / 1000)
        self.metrics.tokens(total, 0)
        data = []
        for i, tokens in enumerate(inputs):
            vec = embedding(tokens, sim.embedding_dim, sim.seed)
            value: Any = vec
            if req.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": total, "total_tokens": total}
        return _json({"object": "list", "data": data, "model": model, "usage": usage})


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    error = invalid(
        f"{request.method} {request.url.path}: {'no such route' if status == 404 else 'not allowed'}"
    )
    return _json(error.body, status)


def create_sim_app(config: SimConfig) -> Starlette:
    metrics = SimMetrics(config.model.name, cache_info(config))
    engine = Engine(config, metrics)
    metrics.bind(engine)
    api = _Api(config, engine, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Streaming responses run in an anyio task group, whose first use imports anyio's backend
        # (~20 ms): here rather than in the first request's TTFT.
        async with anyio.create_task_group():
            pass
        yield
        await engine.close()

    routes = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/embeddings", api.embeddings, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_endpoint, methods=["GET"]),
        *admin_routes(config),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_found})
    app.state.engine = engine  # for tests and `doctor`-style introspection in-process
    return app
