"""What a stream's events (or a whole answer) tell infertap: id, model, usage, finish reasons and, when
asked for, the first choice's text. The SSE scanner (sse.py) hands it the few events it parses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StreamFacts:
    """What the scanner learnt from the events seen so far."""

    done: bool = False
    usage: dict[str, Any] | None = None
    response_id: str | None = None
    response_model: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error_events: int = 0
    events: int = 0
    # An answer (not reasoning) output event has been seen: stops the search for one.
    answered: bool = False
    # Output text of the first choice, collected only when capture_chars > 0 (opt-in).
    capture_chars: int = 0
    text: list[str] = field(default_factory=list)
    text_chars: int = 0
    # The Responses API's: the response object its opening events announced (what a
    # `response.failed` that infertap adds repeats), and what to add to the count of events to get
    # the next `sequence_number` (the upstream's numbering, read off the events parsed; it counts
    # every event, so the deltas in between need no parse).
    response: dict[str, Any] | None = None
    sequence_offset: int = 0

    # Written out, where dataclass would generate it: compiled (proxy/compiled/), this costs a
    # tenth of the generated one, which runs as Python, once a request. It sets every field to its
    # declared default; tests/test_compiled.py holds the two to each other.
    def __init__(
        self,
        *,
        capture_chars: int = 0,
    ) -> None:
        self.done = False
        self.usage = None
        self.response_id = None
        self.response_model = None
        self.finish_reasons = []
        self.error_events = 0
        self.events = 0
        self.answered = False
        self.capture_chars = capture_chars
        self.text = []
        self.text_chars = 0
        self.response = None
        self.sequence_offset = 0

    def wants_text(self) -> bool:
        return self.text_chars < self.capture_chars

    def next_sequence(self) -> int:
        """The `sequence_number` an event infertap adds after the events so far should carry."""
        return self.events + self.sequence_offset


def usage_tokens(usage: dict[str, Any]) -> tuple[object, object]:
    """(prompt, completion) tokens of a usage object, whichever API's names it uses."""
    # Chat and text completions name them prompt/completion, the Responses API input/output.
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    return prompt, usage.get("completion_tokens", usage.get("output_tokens"))


def usage_details(usage: dict[str, Any]) -> tuple[object, object]:
    """(cached prompt, reasoning) tokens of a usage object, None where it does not say."""
    prompt = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    completion = usage.get("completion_tokens_details", usage.get("output_tokens_details"))
    return (
        prompt.get("cached_tokens") if isinstance(prompt, dict) else None,
        completion.get("reasoning_tokens") if isinstance(completion, dict) else None,
    )


def _absorb_identity(facts: StreamFacts, obj: dict[str, Any]) -> None:
    """The id, model and usage of a chunk, a whole answer or a Responses API `response`."""
    if facts.response_id is None and isinstance(obj.get("id"), str):
        facts.response_id = obj["id"]
    if facts.response_model is None and isinstance(obj.get("model"), str):
        facts.response_model = obj["model"]
    usage = obj.get("usage")
    if isinstance(usage, dict):
        facts.usage = usage


def absorb_response(facts: StreamFacts, obj: dict[str, Any]) -> None:
    """Take id, model, usage and finish reasons from a chunk or a whole (non-stream) response."""
    _absorb_identity(facts, obj)
    if obj.get("object") == "response":  # a whole (non-stream) Responses API answer
        _absorb_response_object(facts, obj)
        return
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                facts.finish_reasons.append(choice["finish_reason"])
        if facts.wants_text() and choices and isinstance(choices[0], dict):
            _take_text(facts, choices[0])


def absorb_responses_event(facts: StreamFacts, obj: dict[str, Any]) -> None:
    """Take what a Responses API stream event tells: the response's id, model, usage and end."""
    kind = obj.get("type")
    sequence = obj.get("sequence_number")
    if isinstance(sequence, int):
        facts.sequence_offset = sequence + 1 - facts.events
    if kind == "error":
        facts.error_events += 1
        return
    response = obj.get("response")
    if isinstance(response, dict):
        _absorb_identity(facts, response)
        if kind in ("response.created", "response.in_progress", "response.queued"):
            facts.response = response
        elif kind in ("response.completed", "response.incomplete"):
            facts.done = True
            _absorb_response_object(facts, response, text=False)  # the text came as deltas
        elif kind == "response.failed":
            facts.error_events += 1
    elif kind == "response.output_text.delta" and facts.wants_text():
        _append_text(facts, obj.get("delta"))


def _absorb_response_object(facts: StreamFacts, response: dict[str, Any], text: bool = True) -> None:
    """Finish reason (and, when captured, the text) of a finished Responses API `response`."""
    status = response.get("status")
    if status == "completed":
        facts.finish_reasons.append("stop")
    elif status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        facts.finish_reasons.append(reason if isinstance(reason, str) else "incomplete")
    if not (text and facts.wants_text()):
        return
    for item in response.get("output") or ():
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("type") == "output_text":
                    _append_text(facts, part.get("text"))
            return  # the first message only, as the first choice in chat


def _take_text(facts: StreamFacts, choice: dict[str, Any]) -> None:
    """Append the text of a chunk's delta, a message or a completion choice, up to the cap."""
    holder = choice.get("delta", choice.get("message"))
    _append_text(facts, holder.get("content") if isinstance(holder, dict) else choice.get("text"))


def _append_text(facts: StreamFacts, text: object) -> None:
    if isinstance(text, str) and text:
        text = text[: facts.capture_chars - facts.text_chars]
        facts.text.append(text)
        facts.text_chars += len(text)
