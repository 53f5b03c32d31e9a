"""Small ASGI helpers: request bodies, header lists, OpenAI-style JSON errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body: bytes = message.get("body", b"")
        if body:
            size += len(body)
            if size > limit:
                raise BodyTooLarge
            chunks.append(body)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def watch_disconnect(receive: Receive, on_gone: Callable[[], object]) -> asyncio.Task[None]:
    """The one disconnect watcher (the core, the simulated engine, the test upstream): a task that
    reads what is left of the request and calls `on_gone` when the client disconnects. A streamed
    answer notices a disconnect only at its next send; whatever is awaited meanwhile (an upstream,
    a queue) would hold on. Cancel the task when the answer is done."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        on_gone()

    return asyncio.create_task(watch())


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code or kind}})


async def send_json(send: Send, status: int, payload: bytes, extra_headers: RawHeaders | None = None) -> None:
    headers: RawHeaders = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def send_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    extra_headers: RawHeaders | None = None,
    param: str | None = None,
) -> None:
    await send_json(send, status, error_body(message, kind, code, param), extra_headers)
