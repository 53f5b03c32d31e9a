"""Tool calls for the simulated engine: whether a request calls a tool, which one, with what arguments.

A request with `tools` calls one when `tool_choice` is "required" or names a function; with "auto"
(the default) it calls one or answers in text, decided by a seeded draw over the sim's seed, the
request's `seed` and the prompt, so the same request always gets the same kind of answer. An "auto"
request whose last message is a tool result answers in text: an agent loop ends. The arguments are
JSON that fits the tool's `parameters` schema (types, enums, required properties), drawn from the
same seed. The engine generates one token for the call's header (id and name) and one per argument
fragment, so a tool call is timed by the same prefill/decode model as text.
"""

from __future__ import annotations

import hashlib
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.sim.protocol import ApiError, ChatRequest, ResponsesRequest, invalid

_WORDS = ("Paris", "Berlin", "blue", "seven", "report", "tomorrow", "alpha", "north", "green", "Tokyo")
# JSON split roughly where a tokenizer would split it: punctuation, quotes, words, spaces.
_FRAGMENT = re.compile(r'\s+|[{}\[\]:,"]|[^\s{}\[\]:,"]+')


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def fragments(self) -> list[str]:
        """The argument text in pieces, one per generated token after the header."""
        return _FRAGMENT.findall(self.arguments) or [self.arguments]

    @property
    def tokens(self) -> int:
        return 1 + len(self.fragments)


def _function(tool: Any, responses: bool) -> dict[str, Any] | None:
    """The function definition of a tool: chat nests it under "function", Responses does not."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return None
    fn = tool if responses else tool.get("function")
    return fn if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def _named(choice: Any, responses: bool) -> str | None:
    if not isinstance(choice, dict):
        return None
    holder = choice if responses else choice.get("function")
    name = holder.get("name") if isinstance(holder, dict) else None
    return name if isinstance(name, str) else None


def _value(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    if not isinstance(schema, dict):
        return rng.choice(_WORDS)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object" or (kind is None and "properties" in schema):
        return _object(schema, rng, depth + 1) if depth < 4 else {}
    if kind == "array":
        return [_value(schema.get("items"), rng, depth + 1) for _ in range(rng.randint(1, 3))]
    if kind == "integer":
        return rng.randint(1, 100)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    return rng.choice(_WORDS)


def _object(schema: dict[str, Any], rng: random.Random, depth: int = 0) -> dict[str, Any]:
    props = schema.get("properties")
    if not isinstance(props, dict):
        return {}
    required = schema.get("required")
    keep = set(required) if isinstance(required, list) else set(props)
    # every required property, and the optional ones on a coin flip
    return {k: _value(v, rng, depth) for k, v in props.items() if k in keep or rng.random() < 0.5}


def _last_turn(req: ChatRequest | ResponsesRequest) -> str | None:
    """The role (chat) or item type (Responses) of the request's last message."""
    if isinstance(req, ChatRequest):
        return req.messages[-1].role
    if isinstance(req.input, str) or not req.input:
        return "user"
    last = req.input[-1]
    return last.role or str((last.model_extra or {}).get("type"))


def plan_tool_call(req: ChatRequest | ResponsesRequest, prompt: list[str], seed: int) -> ToolCall | None:
    """The tool call this request gets, or None for a text answer."""
    responses = isinstance(req, ResponsesRequest)
    body = req.model_extra or {}
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise invalid("tools: must be a list", param="tools")
    functions = [fn for t in tools if (fn := _function(t, responses)) is not None]
    choice = body.get("tool_choice", "auto")
    if choice == "none" or not functions:
        return None
    key = f"{seed}|{req.seed}|{' '.join(prompt)}".encode()
    rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
    named = _named(choice, responses)
    if named is not None:
        chosen = next((fn for fn in functions if fn["name"] == named), None)
        if chosen is None:
            raise ApiError(
                400,
                {"error": {"message": f"tool_choice names {named!r}, which is not among the tools",
                           "type": "invalid_request_error", "param": "tool_choice", "code": None}},
            )  # fmt: skip
    elif choice == "required":
        chosen = rng.choice(functions)
    elif choice == "auto":
        if _last_turn(req) in ("tool", "function_call_output"):
            return None  # the tool's result is in: answer it in text
        if rng.random() < 0.5:
            return None
        chosen = rng.choice(functions)
    else:
        raise invalid("tool_choice: use 'none', 'auto', 'required' or name a function", param="tool_choice")
    arguments = _object(chosen.get("parameters") or {}, rng)
    return ToolCall(chosen["name"], orjson.dumps(arguments).decode())


# -- the chat completions wire format of a call ---------------------------------------------------
def tool_call_choice(call: ToolCall, i: int) -> dict[str, Any]:
    """The streamed choice of token i: the header (id, type, name, no arguments yet), then each
    argument fragment, as OpenAI streams them."""
    if i == 0:
        entry: dict[str, Any] = {"index": 0, "id": call.call_id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}  # fmt: skip
        delta: dict[str, Any] = {"content": None, "tool_calls": [entry]}
    else:
        fragments = call.fragments
        piece = fragments[i - 1] if i - 1 < len(fragments) else ""
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}


def tool_call_message(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]}  # fmt: skip
