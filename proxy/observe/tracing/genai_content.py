"""A request's prompt in the GenAI conventions' message shape (`gen_ai.input.messages`).

Only for opt-in content capture (`[tracing] capture_content`): text is cut to a character budget,
and images, audio and files are recorded by their kind, never their data. Pure: no OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Budget:
    """Characters of content left to record; cuts text once `content_max_chars` are used."""

    def __init__(self, limit: int) -> None:
        self.left = limit
        self.cut = False

    def take(self, text: str) -> str:
        if len(text) > self.left:
            text = text[: self.left]
            self.cut = True
        self.left -= len(text)
        return text


def _parts(content: Any, budget: Budget) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "content": budget.take(content)}]
    parts: list[dict[str, Any]] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                parts.append({"type": "text", "content": budget.take(part)})
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append({"type": "text", "content": budget.take(part["text"])})
            elif isinstance(part, dict):  # images, audio, files: their kind, never their data
                parts.append({"type": str(part.get("type", "unknown"))})
    return parts


def input_messages(route: str, request: Mapping[str, Any], budget: Budget) -> list[dict[str, Any]]:
    """`gen_ai.input.messages` in the GenAI conventions' shape, text cut to the budget."""
    if route == "chat.completions" and isinstance(request.get("messages"), list):
        out: list[dict[str, Any]] = []
        for m in request["messages"]:
            if not isinstance(m, dict):
                continue
            parts = _parts(m.get("content"), budget)
            for call in m.get("tool_calls") or []:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    fn = call["function"]
                    args = fn.get("arguments")
                    parts.append(
                        {
                            "type": "tool_call",
                            "id": call.get("id"),
                            "name": fn.get("name"),
                            "arguments": budget.take(args) if isinstance(args, str) else None,
                        }
                    )
            out.append({"role": str(m.get("role", "user")), "parts": parts})
        return out
    if route == "completions":
        return [{"role": "user", "parts": _parts(request.get("prompt"), budget)}]
    if route == "responses":
        out = []
        if isinstance(request.get("instructions"), str):
            out.append({"role": "system", "parts": _parts(request["instructions"], budget)})
        items = request.get("input")
        if isinstance(items, str):
            out.append({"role": "user", "parts": _parts(items, budget)})
        elif isinstance(items, list):
            for item in items:  # messages; other items (tool outputs, reasoning) are left out
                if isinstance(item, dict) and "role" in item:
                    out.append({"role": str(item["role"]), "parts": _parts(item.get("content"), budget)})
        return out
    return []
