"""The Responses API's wire format (POST /v1/responses) for the simulated engine.

A stream is a sequence of typed events, each sent with its `event:` line as OpenAI and vLLM do:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
one response.output_text.delta per token, then the matching .done events and response.completed
(or response.incomplete when max_output_tokens cut the answer), which carries the usage. There is
no `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from proxy.sim.protocol import ResponsesRequest
from proxy.sim.tools import ToolCall


class ResponsesFormat:
    """Events and the whole body of one Responses API answer (the sim's _Format interface)."""

    def __init__(self, model: str, req: ResponsesRequest, tool: ToolCall | None = None) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.tool = tool
        self.item_id = f"{'fc' if tool else 'msg'}_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())
        self.echo = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
        }
        self.sequence = 0
        self.text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, text: str | None) -> dict[str, Any]:
        if self.tool is not None:
            call = self.tool
            return {"id": self.item_id, "type": "function_call", "status": status, "call_id": call.call_id,
                    "name": call.name, "arguments": text or ""}  # fmt: skip
        content = [] if text is None else [self._part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            **self.echo,
        }
        if usage is not None:
            body["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        return body

    @staticmethod
    def _status(reason: str) -> str:
        return "incomplete" if reason == "length" else "completed"

    def first(self) -> bytes:
        if self.tool is not None:  # the function call item opens with the first generated token
            return self._event("response.created", response=self._response("in_progress", [])) + self._event(
                "response.in_progress", response=self._response("in_progress", [])
            )
        # Everything before the first token goes at once, as the chat role chunk does.
        return b"".join(
            (
                self._event("response.created", response=self._response("in_progress", [])),
                self._event("response.in_progress", response=self._response("in_progress", [])),
                self._event(
                    "response.output_item.added", output_index=0, item=self._item("in_progress", None)
                ),
                self._event(
                    "response.content_part.added",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    part=self._part(""),
                ),
            )
        )

    def token(self, text: str) -> bytes:
        if self.tool is not None:
            return self._tool_token()
        self.text.append(text)
        return self._event(
            "response.output_text.delta",
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _tool_token(self) -> bytes:
        # The header (name, call id) first, then the arguments one fragment a token.
        assert self.tool is not None
        i, fragments = len(self.text), self.tool.fragments
        self.text.append("" if i == 0 or i > len(fragments) else fragments[i - 1])
        if i == 0:
            return self._event(
                "response.output_item.added", output_index=0, item=self._item("in_progress", "")
            )
        where = {"item_id": self.item_id, "output_index": 0}
        return self._event("response.function_call_arguments.delta", **where, delta=self.text[-1])

    def end(self, reason: str, usage: dict[str, int]) -> bytes:
        if self.tool is not None:
            arguments = "".join(self.text)
            status = self._status(reason)
            item = self._item("completed", arguments)
            where = {"item_id": self.item_id, "output_index": 0}
            return b"".join(
                (
                    self._event("response.function_call_arguments.done", **where, arguments=arguments),
                    self._event("response.output_item.done", output_index=0, item=item),
                    self._event(f"response.{status}", response=self._response(status, [item], usage)),
                )
            )
        text = "".join(self.text)
        status = self._status(reason)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = self._item("completed", text)
        return b"".join(
            (
                self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=self._part(text)),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event(f"response.{status}", response=self._response(status, [item], usage)),
            )
        )

    def whole(self, text: str, reason: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.tool is not None:
            text = self.tool.arguments
        return self._response(self._status(reason), [self._item("completed", text)], usage)
