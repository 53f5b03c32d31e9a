"""Intake: what infertap must understand of a request's body, and nothing more (the model, the
stream flag, the prompt's size), and the one change it makes to it (asking a stream for usage)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import orjson

from proxy.core.balance import stable_hash
from proxy.core.exchange import Exchange, prompt_class
from proxy.core.route_table import Route

MAX_JSON_CAPTURE = 8 * 1024 * 1024


def prompt_chars(obj: dict[str, Any]) -> int:
    """Characters of prompt text, for the prompt size class (exact tokens come later, from usage)."""
    total = 0
    messages = obj.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, str):
                    total += len(content)
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            total += len(part["text"])
    prompt = obj.get("prompt", obj.get("input"))
    if isinstance(prompt, str):
        total += len(prompt)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        # Responses API input items: {"role": ..., "content": str | [{"type": "input_text", "text": ...}]}
        total += prompt_chars({"messages": prompt})
    elif isinstance(prompt, list):
        total += sum(len(p) for p in prompt if isinstance(p, str))
    instructions = obj.get("instructions")
    if isinstance(instructions, str):
        total += len(instructions)
    return total


def fill_record(ex: Exchange, obj: dict[str, Any], bounds: tuple[int, ...]) -> None:
    """The request record's fields that come from a parsed JSON body."""
    ex.request_json = obj
    ex.model = obj["model"]
    ex.stream = obj.get("stream") is True
    ex.prompt_chars = prompt_chars(obj)
    ex.prompt_class = prompt_class(ex.estimated_prompt_tokens, bounds)
    ex.params = {k: obj[k] for k in _PARAMS if k in obj}


_PARAMS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "top_p")


def with_usage(ex: Exchange, obj: dict[str, Any], body: bytes, upstream_rejects_it: bool) -> bytes:
    """The body with `stream_options.include_usage` added, so that a stream reports its token
    usage; unchanged when the client decided itself, or the upstream rejects stream_options.

    The client's bytes are kept as sent and the member is spliced in: re-serializing would change
    what a parser reads differently (an integer over 64 bits becomes a float) and fails where
    reading did not (orjson writes 255 levels of nesting, reads 1,024)."""
    opts = obj.get("stream_options")
    if isinstance(opts, dict) and "include_usage" in opts:
        return body
    if upstream_rejects_it or (opts is not None and not isinstance(opts, dict)):
        return body
    if "stream_options" not in obj:
        # A valid JSON object with a model: its first "{" opens it (whitespace holds none), and
        # it has a member, so the comma is right.
        at = body.index(b"{") + 1
        spliced = body[:at] + b'"stream_options":{"include_usage":true},' + body[at:]
    else:  # `null` or an object without include_usage, as its last top-level occurrence reads
        at = _top_level_value(body, "stream_options")
        if body.startswith(b"null", at):
            spliced = body[:at] + b'{"include_usage":true}' + body[at + 4 :]
        else:
            inner = _skip_ws(body, at + 1)
            member = b'"include_usage":true' if body[inner : inner + 1] == b"}" else b'"include_usage":true,'
            spliced = body[: at + 1] + member + body[at + 1 :]
    ex.usage_injected = True
    return spliced


# A JSON string (escapes included) or a bracket: what changes the depth, or may be a key.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]]', re.DOTALL)
_WS = b" \t\r\n"


def _skip_ws(body: bytes, at: int) -> int:
    while at < len(body) and body[at] in _WS:
        at += 1
    return at


def _top_level_value(body: bytes, key: str) -> int:
    """Where the value of the last top-level member `key` of a valid JSON object starts (the last,
    as orjson and most parsers keep the last of duplicate keys)."""
    depth = 0
    found = -1
    for m in _TOKEN.finditer(body):
        first = m.group()[:1]
        if first == b'"':
            if depth == 1:
                colon = _skip_ws(body, m.end())
                if body[colon : colon + 1] == b":" and orjson.loads(m.group()) == key:
                    found = _skip_ws(body, colon + 1)
        elif first in (b"{", b"["):
            depth += 1
        else:
            depth -= 1
    if found < 0:
        raise ValueError(f"no top-level {key!r} in the body")
    return found


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def parse_request(route: Route, body: bytes) -> dict[str, Any] | None:
    """Validate what infertap itself must understand; everything else is the upstream's business.
    The parsed body of a JSON route; None for a route whose body infertap does not read."""
    if not route.json_body:
        return None
    if not body.strip():
        raise RequestRejected(400, "the request body is empty: send a JSON object", "invalid_json")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestRejected(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        raise RequestRejected(400, f"the request body must be a JSON object, got {kind}", "invalid_json")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise RequestRejected(
            400, "'model' is required and must be a non-empty string", "missing_model", "model"
        )
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestRejected(400, "'stream' must be true or false", "invalid_stream", "stream")
    return obj


AFFINITY_PROMPT_CHARS = 2048  # /v1/completions: the prompt's first characters name the conversation


def affinity_key(
    obj: dict[str, Any] | None, headers: Iterable[tuple[bytes, bytes]], session: bytes
) -> int | None:
    """prefix_affinity's key: the client's session header when it sends one, else a hash of what
    every turn of a conversation starts with (the system prompt(s) and the first user turn, or a
    completion prompt's first characters). None: nothing names it (the pool balances by load)."""
    for name, value in headers:
        if name == session and value:
            return stable_hash(b"s\0" + value)
    if obj is None:
        return None
    messages = obj.get("messages")
    if not isinstance(messages, list):
        messages = obj.get("input") if isinstance(obj.get("input"), list) else None
    lead: list[Any] = []
    instructions = obj.get("instructions")
    if isinstance(instructions, str):
        lead.append(instructions)
    if messages:
        for m in messages:
            if not isinstance(m, dict):
                break
            lead.append(m.get("content"))
            if m.get("role") not in ("system", "developer"):
                break  # the first turn after the system prompt(s) ends the conversation's name
    if lead:
        try:
            return stable_hash(b"m\0" + orjson.dumps(lead))
        except TypeError:
            return None
    prompt = obj.get("prompt", obj.get("input"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return stable_hash(b"p\0" + prompt[:AFFINITY_PROMPT_CHARS].encode("utf-8", "surrogatepass"))
    return None
