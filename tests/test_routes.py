"""The route table: what each proxied route is, in one place."""

from __future__ import annotations

from proxy.core.route_table import BY_LABEL, OTHER, PROXIED, route_of
from proxy.core.sse import ResponsesScanner, SSEScanner


def test_the_proxied_routes() -> None:
    assert {p: r.label for p, r in PROXIED.items()} == {
        "/v1/chat/completions": "chat.completions",
        "/v1/completions": "completions",
        "/v1/responses": "responses",
        "/v1/embeddings": "embeddings",
    }
    assert all(r.method == "POST" and r.json_body for r in PROXIED.values())
    # Exactly the generation routes have a scanner; only the [DONE]-style ones get stream_options.
    assert {r.label for r in PROXIED.values() if r.generation} == {
        "chat.completions",
        "completions",
        "responses",
    }
    assert all((r.scanner is not None) == r.generation for r in BY_LABEL.values())
    assert route_of("responses").scanner is ResponsesScanner
    assert route_of("chat.completions").scanner is SSEScanner
    assert {r.label for r in BY_LABEL.values() if r.stream_options} == {"chat.completions", "completions"}


def test_span_operations_and_the_passthrough() -> None:
    assert {r.label: r.operation for r in BY_LABEL.values()} == {
        "chat.completions": "chat",
        "completions": "text_completion",
        "responses": "chat",
        "embeddings": "embeddings",
        "other": None,
    }
    assert route_of("other") is OTHER and route_of("no such label") is OTHER
    assert not OTHER.json_body and not OTHER.generation
