"""Metrics.ended finds a request's children through one lookup of its labels' combination, asking
prometheus_client for each child the first time that combination needs it (proxy/observe/metrics/
prometheus.py, `_ended`). The class of bug this guards: a kept child counted under another
combination's labels, or a series made that the request never counted into (a zero series where
there was none). Randomized: any sequence of requests, ended through a Metrics whose lists are
kept and through one that forgets them before every request, gives the same exposition; and past
MAX_ENDED_KEYS combinations the lists start again without losing a count."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.exchange import Exchange, Outcome
from proxy.observe.metrics.prometheus import MAX_ENDED_KEYS, Metrics
from tests.conftest import make_settings
from tests.promtext import samples, value
from tests.test_circuit import CLOSED_PORT

ROUTES = ("chat.completions", "embeddings", "completions")


def exposition(metrics: Metrics) -> list[tuple[str, dict[str, str], float]]:
    # Without each series' creation time, which differs between two instances.
    return sorted(
        (s for s in samples(metrics.render(None)[0].decode()) if not s[0].endswith("_created")),
        key=repr,
    )


_request = st.fixed_dictionaries(
    {
        "route": st.sampled_from(ROUTES),
        "model": st.sampled_from(["m1", "m2", None]),
        "routed": st.sampled_from(["a", "b"]),
        "upstream": st.sampled_from(["a", "b", None]),
        "stream": st.booleans(),
        "outcome": st.sampled_from(list(Outcome)),
        "client": st.sampled_from(["anonymous", "team-x"]),
        "attempts": st.integers(0, 2),
        "prompt": st.none() | st.integers(0, 50),
        "completion": st.none() | st.integers(0, 50),
        "cached": st.none() | st.integers(0, 5),
        "reasoning": st.none() | st.integers(0, 5),
        "events": st.integers(0, 4),
        "answered": st.booleans(),
    }
)


def end(metrics: Metrics, r: dict[str, object]) -> None:
    route = str(r["route"])
    model = r["model"] if isinstance(r["model"], str) else None
    routed = str(r["routed"])
    ex = Exchange("r", route, "POST", f"/v1/{route}", received_at=100.0, model=model, upstream=routed)
    metrics.request_received(ex)
    ex.upstream = r["upstream"] if isinstance(r["upstream"], str) else None
    ex.stream = bool(r["stream"])
    ex.client = str(r["client"])
    ex.attempts = int(r["attempts"])  # type: ignore[call-overload]
    ex.prompt_tokens = r["prompt"]  # type: ignore[assignment]
    ex.completion_tokens = r["completion"]  # type: ignore[assignment]
    ex.cached_tokens = r["cached"]  # type: ignore[assignment]
    ex.reasoning_tokens = r["reasoning"]  # type: ignore[assignment]
    events = int(r["events"])  # type: ignore[call-overload]
    if events:
        ex.first_token_at = 100.25
        ex.last_token_at = 100.25 + 0.01 * (events - 1)
        ex.output_events = events
        if r["answered"]:
            ex.first_answer_at = 100.5
    ex.finished_at = 101.0
    ex.outcome = r["outcome"]  # type: ignore[assignment]
    metrics.ended(ex)


@settings(max_examples=60, deadline=None)
@given(st.lists(_request, min_size=1, max_size=12))
def test_kept_children_count_what_children_asked_anew_count(requests: list[dict[str, object]]) -> None:
    kept = Metrics(make_settings(("a", CLOSED_PORT), ("b", CLOSED_PORT)))
    anew = Metrics(make_settings(("a", CLOSED_PORT), ("b", CLOSED_PORT)))
    for r in requests:
        end(kept, r)
        anew._ended.clear()
        end(anew, r)
    assert exposition(kept) == exposition(anew)


def test_past_the_cap_the_lists_start_again_and_every_request_is_counted() -> None:
    metrics = Metrics(make_settings(("a", CLOSED_PORT)))
    n = MAX_ENDED_KEYS + 10
    for i in range(n):
        ex = Exchange("r", "chat.completions", "POST", "/v1/chat/completions", received_at=1.0, upstream="a")
        metrics.request_received(ex)
        ex.client = f"c{i}"  # a combination of its own each
        ex.finished_at = 2.0
        ex.outcome = Outcome.OK
        metrics.ended(ex)
        assert len(metrics._ended) <= MAX_ENDED_KEYS
    text = metrics.render(None)[0].decode()
    assert value(text, "infertap_requests_total", outcome="ok") == n
    assert value(text, "infertap_in_flight_requests", upstream="a") == 0
