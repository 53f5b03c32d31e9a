"""The one route table: the proxied OpenAI routes and what infertap knows about each.

Pure (stdlib, proxy.core.sse and proxy.core.error_events). The app dispatches on it, the core
parses, scans and ends failed streams by it, and the observers label, name spans and count tokens
by it; none of them keeps a list of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.core.error_events import chat_error_event, responses_error_events
from proxy.core.sse import ResponsesScanner, SSEScanner
from proxy.core.stream_facts import StreamFacts

# (message, kind, what the stream told so far) -> the bytes that end a committed stream in-band.
ErrorEventBuilder = Callable[[str, str, StreamFacts | None], bytes]


@dataclass(frozen=True, slots=True)
class Route:
    label: str  # the `route` label of every metric, and Exchange.route
    path: str  # as the client sends it; "/v1/*" for the passthrough
    method: str  # the one method the route accepts ("*": any)
    # Generates text: its streams carry output events (TTFT, TPOT, output tokens).
    generation: bool = False
    # Its body is a JSON object that names a model (parsed and checked before it goes upstream).
    json_body: bool = False
    # Its streams end with `data: [DONE]` and carry usage only when asked (stream_options); the
    # Responses API always puts usage in its final `response.completed` event instead.
    stream_options: bool = False
    # Scans a generation stream; None for routes whose answers are relayed without a look.
    scanner: type[SSEScanner] | None = None
    # How a failure after commit is told inside the stream, in the shape this API's clients read.
    error_event: ErrorEventBuilder = chat_error_event
    # The GenAI semantic conventions' `gen_ai.operation.name`; None: a plain HTTP span.
    operation: str | None = None
    # What the OpenAPI document says about it.
    summary: str = ""


CHAT = Route(
    "chat.completions",
    "/v1/chat/completions",
    "POST",
    generation=True,
    json_body=True,
    stream_options=True,
    scanner=SSEScanner,
    operation="chat",
    summary="Chat completions (streamed or not)",
)
COMPLETIONS = Route(
    "completions",
    "/v1/completions",
    "POST",
    generation=True,
    json_body=True,
    stream_options=True,
    scanner=SSEScanner,
    operation="text_completion",
    summary="Text completions (streamed or not)",
)
RESPONSES = Route(
    "responses",
    "/v1/responses",
    "POST",
    generation=True,
    json_body=True,
    scanner=ResponsesScanner,
    error_event=responses_error_events,
    # The GenAI conventions have no name of their own for the Responses API.
    operation="chat",
    summary="The Responses API (streamed or not)",
)
EMBEDDINGS = Route(
    "embeddings", "/v1/embeddings", "POST", json_body=True, operation="embeddings", summary="Embeddings"
)
# Any other /v1/ path: relayed as is (path checked to stay under the upstream's base path).
OTHER = Route("other", "/v1/*", "*", summary="Any other OpenAI path, relayed as is")

PROXIED: dict[str, Route] = {r.path: r for r in (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)}
BY_LABEL: dict[str, Route] = {r.label: r for r in (*PROXIED.values(), OTHER)}


def route_of(label: str) -> Route:
    """The route of an Exchange's `route` label (an unknown label is the passthrough's)."""
    return BY_LABEL.get(label, OTHER)
