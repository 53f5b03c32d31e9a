"""The in-band error that ends a stream infertap already committed to, in the shape of the client's API.

Once the status and the first events are on their way, a failure can only be told inside the
stream. Each API's SDKs look for their own shape, so the route chooses the builder
(route_table.Route.error_event):

- chat and text completions: `data: {"error": {...}}`, on which the OpenAI SDKs raise;
- the Responses API: an `error` event, then `response.failed`, as OpenAI ends a failed response.
  A chat-shaped event there had no `type`, and Vercel's AI SDK failed on it with a schema dump
  instead of the message.

Either is appended after the last complete event the client received: the relay never forwards
half an event, so the error always starts on an event boundary.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from proxy.core.stream_facts import StreamFacts


def chat_error_event(message: str, kind: str, facts: StreamFacts | None = None) -> bytes:
    """`data: {"error": {...}}`: the shape OpenAI uses mid-stream, which its SDKs raise on."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": kind}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def responses_error_events(message: str, kind: str, facts: StreamFacts | None = None) -> bytes:
    """`event: error`, then `event: response.failed`, numbered on from the upstream's last event.

    The `error` event carries the documented fields at its top level (`code`, `message`, `param`)
    and, as OpenAI's live API sends them, again under `error`: each version of Vercel's AI SDK
    validates one of the two layouts, and the OpenAI SDKs raise on an `error` key. `code` is
    infertap's kind (`stream_interrupted`, `idle_timeout`, ...). Then `response.failed`, for the
    clients that wait for a terminal event: the response the stream opened with (its id, which
    openai-python's stream helper checks, and the request's settings), failed with OpenAI's own
    code for a failure on the serving side, `server_error` (its SDKs' types admit no other).
    """
    facts = facts if facts is not None else StreamFacts()
    sequence = facts.next_sequence()
    error = {"type": kind, "code": kind, "message": message, "param": None}
    first = {"type": "error", "sequence_number": sequence, "code": kind, "message": message, "param": None}
    opened = facts.response or {
        "id": facts.response_id or "resp_failed",
        "object": "response",
        "created_at": int(time.time()),
        "model": facts.response_model or "",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    response: dict[str, Any] = {
        **opened,
        "status": "failed",
        "error": {"code": "server_error", "message": message},
        "incomplete_details": None,
    }
    failed = {"type": "response.failed", "sequence_number": sequence + 1, "response": response}
    return b"".join(
        (
            b"event: error\ndata: ",
            orjson.dumps({**first, "error": error}),
            b"\n\nevent: response.failed\ndata: ",
            orjson.dumps(failed),
            b"\n\n",
        )
    )
