"""The per-upstream gauges follow a reload: a new upstream gets its series at once (as at start-up),
a removed one's `infertap_upstream_up` leaves the exposition. Regression: a removed upstream whose
circuit was open kept `infertap_upstream_up 0` until a restart, and InfertapUpstreamDown paged for
an upstream that no longer existed. A real `infertap serve --config FILE` (one worker and two), a
fake upstream, an upstream nothing listens on, on 127.0.0.1."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from proxy.core.exchange import Exchange, Outcome
from proxy.observe.metrics.prometheus import IN_FLIGHT, UPSTREAM_UP, Metrics
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, free_port, make_settings, serve_process, wait_until
from tests.promtext import samples
from tests.test_circuit import CLOSED_PORT
from tests.test_reload import ADMIN, ENV


def config_file(admin_port: int, upstreams: dict[str, str]) -> str:
    """Upstream `a` is the default; every other one takes the models named after it (`b-1`, ...).
    One refused connection opens a circuit, for ten minutes."""
    text = f"""
[server]
admin_port = {admin_port}
[auth]
admin_token_env = "RT_ADMIN"
[retry]
max_attempts = 1
[circuit]
min_calls = 1
cooldown_seconds = 600
when_all_open = "refuse"
[metrics]
access_log = false
"""
    for name, url in upstreams.items():
        route = "default = true" if name == "a" else f'models = ["{name}-*"]'
        text += f'[[upstreams]]\nname = "{name}"\nbase_url = "{url}"\n{route}\n'
    return text


def gauge(text: str, name: str) -> dict[str, float]:
    """upstream -> value of the gauge `name`."""
    return {lab["upstream"]: v for n, lab, v in samples(text) if n == name}


def up(text: str) -> dict[str, float]:
    return gauge(text, UPSTREAM_UP)


def scrapes(base: str, workers: int) -> list[str]:
    """/metrics once from each worker (a new connection each, until every worker has answered)."""
    answers: dict[str, str] = {}

    def all_answered() -> bool:
        r = httpx.get(f"{base}/metrics", headers={"connection": "close"})
        assert r.status_code == 200, r.text
        answers[r.headers["x-request-id"].rsplit("-", 1)[0]] = r.text
        return len(answers) == workers

    wait_until(all_answered, 60, f"/metrics from all {workers} workers")
    return list(answers.values())


@pytest.mark.parametrize("workers", [1, 2])
def test_a_removed_upstream_leaves_upstream_up_and_a_new_one_gets_it(
    tmp_path: Path, fake: tuple[FakeUpstream, str], workers: int
) -> None:
    _, url = fake
    admin_port = free_port()
    path = tmp_path / "config.toml"
    path.write_text(config_file(admin_port, {"a": url, "b": CLOSED_PORT}))
    env = {**os.environ, **ENV}
    args = ("--config", str(path), "--workers", str(workers))

    def reload(upstreams: dict[str, str]) -> None:
        path.write_text(config_file(admin_port, upstreams))
        r = httpx.post(f"http://127.0.0.1:{admin_port}/admin/reload", headers=ADMIN, timeout=10)
        assert r.status_code == 200 and r.json()["applied"] == ["upstreams"], r.text

    with serve_process(*args, env=env, log=tmp_path / "serve.log") as (base, _):
        for text in scrapes(base, workers):
            assert up(text) == {"a": 1, "b": 1}
        # b refuses connections: one request opens its circuit (in the worker that sent it; the
        # instance's value is the minimum over workers).
        r = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "model": "b-1"}, timeout=30)
        assert r.status_code == 502, r.text
        for text in scrapes(base, workers):
            assert up(text) == {"a": 1, "b": 0}  # what pages: InfertapUpstreamDown

        reload({"a": url, "c": url})  # b removed while down, c added
        for text in scrapes(base, workers):
            assert up(text) == {"a": 1, "c": 1}
            assert gauge(text, IN_FLIGHT) == {"a": 0, "c": 0}
            # Counters are history: b's stay, unchanged, until a restart.
            b_requests = [
                v for n, lab, v in samples(text) if n == "infertap_requests_total" and lab["upstream"] == "b"
            ]
            assert b_requests == [1]
            assert any(
                lab.get("upstream") == "c" for n, lab, _ in samples(text) if n == "infertap_timeouts_total"
            )
        ok = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "model": "c-1"}, timeout=30)
        assert ok.status_code == 200, ok.text

        # b back under its name, at an address that answers: a new upstream, a new (closed) circuit.
        reload({"a": url, "b": url})
        settle(base, workers, {"a": 1, "b": 1})
        ok = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "model": "b-1"}, timeout=30)
        assert ok.status_code == 200, ok.text

        # A kept name at a new base URL gets a new circuit too: its upstream_up goes back to 1.
        reload({"a": url, "b": CLOSED_PORT})
        r = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "model": "b-1"}, timeout=30)
        assert r.status_code == 502, r.text
        assert 0 in [up(text)["b"] for text in scrapes(base, workers)]
        reload({"a": url, "b": url})
        # The worker whose circuit was open holds b's 0 in its own metrics file until it follows
        # the reload: at its next request, or within PEER_POLL_SECONDS when idle.
        settle(base, workers, {"a": 1, "b": 1})


def settle(base: str, workers: int, expected: dict[str, float]) -> None:
    """Every worker's /metrics shows `expected` as upstream_up, within a few poll periods."""
    wait_until(
        lambda: all(up(text) == expected for text in scrapes(base, workers)), 10, f"upstream_up {expected}"
    )


def test_a_removed_upstreams_in_flight_count_shows_until_its_requests_end() -> None:
    """A request routed to b before the reload that removed b is still served: counted until it ends."""
    metrics = Metrics(make_settings(("a", CLOSED_PORT), ("b", CLOSED_PORT)))
    ex = Exchange("r", "chat.completions", "POST", "/v1/chat/completions", upstream="b")
    metrics.request_received(ex)
    metrics.configuration_changed(make_settings(("a", CLOSED_PORT), ("c", CLOSED_PORT)), {"c"})
    text = metrics.render(None)[0].decode()
    assert (up(text), gauge(text, IN_FLIGHT)) == ({"a": 1, "c": 1}, {"a": 0, "b": 1, "c": 0})
    ex.outcome = Outcome.CLIENT_DISCONNECT
    metrics.ended(ex)
    text = metrics.render(None)[0].decode()
    assert (up(text), gauge(text, IN_FLIGHT)) == ({"a": 1, "c": 1}, {"a": 0, "c": 0})
