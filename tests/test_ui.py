"""The built-in page: /ui/data agrees with /metrics, lists requests, hides secrets, obeys config."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.observe.ui.data import Reservoir, SecondRing, quantiles
from proxy.settings import (
    AuthSettings,
    CircuitSettings,
    ConfigError,
    RetrySettings,
    Settings,
    TimeoutSettings,
    UISettings,
    UpstreamSettings,
    load_settings,
)
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import make_settings, run_proxy, wait_until
from tests.promtext import samples, scrape, value

MARKER = "PROMPT-MARKER-7f3a"
QS = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def chat(model: str = "fake-model", stream: bool = True) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": f"{MARKER} hello"}]}


def ui_data(proxy: str, **headers: str) -> dict[str, Any]:
    r = httpx.get(f"{proxy}/ui/data", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    data: dict[str, Any] = r.json()
    return data


def settings_for(url: str, **extra: Any) -> Settings:
    base: dict[str, Any] = {
        "timeouts": TimeoutSettings(idle=0.3),
        "retry": RetrySettings(max_attempts=2, backoff_seconds=0),
        "circuit": CircuitSettings(failure_threshold=1000),
    }
    return make_settings(("fake", url), **{**base, **extra})


def disconnect_after_first_chunk(client: httpx.Client, proxy: str, rid: str) -> None:
    headers = {"x-fake-hang": "after-first", "x-request-id": rid}
    with client.stream("POST", f"{proxy}/v1/chat/completions", json=chat(), headers=headers) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the first content event: the stream is committed; then leave


# (request id, headers, body, expected outcome), sent one after another.
def workload() -> list[tuple[str, dict[str, str], Any, str]]:
    plan: list[tuple[str, dict[str, str], Any, str]] = []
    for i, ttft in enumerate((0, 3, 8, 15, 30, 45, 70, 90, 120, 210, 260)):
        gap = (0, 1, 3, 6)[i % 4]
        hdr = {"x-fake-ttft-ms": str(ttft), "x-fake-gap-ms": str(gap), "x-fake-events": str(4 + i % 3)}
        plan.append((f"ok-{i}", hdr, chat("fake-model" if i % 3 else "other-model"), "ok"))
    plan.append(("plain-0", {"x-fake-events": "3"}, chat(stream=False), "ok"))
    plan.append(("err-0", {"x-fake-status": "500"}, chat(), "upstream_error"))
    plan.append(("limited-0", {"x-fake-status": "429"}, chat(), "rate_limited"))
    plan.append(("idle-0", {"x-fake-hang": "after-first"}, chat(), "idle_timeout"))
    plan.append(("ttft-0", {"x-fake-hang": "before-headers"}, chat(), "ttft_timeout"))
    plan.append(("cut-0", {"x-fake-cut": "2"}, chat(), "stream_interrupted"))
    plan.append(("bad-0", {}, b"not json", "rejected"))
    plan.append(("gone-0", {}, None, "client_disconnect"))
    return plan


def run_workload(client: httpx.Client, proxy: str) -> list[tuple[str, str]]:
    sent: list[tuple[str, str]] = []
    for rid, hdr, body, outcome in workload():
        if body is None:
            disconnect_after_first_chunk(client, proxy, rid)
        else:
            headers = {**hdr, "x-request-id": rid}
            if isinstance(body, bytes):
                client.post(f"{proxy}/v1/chat/completions", content=body, headers=headers)
            else:
                client.post(f"{proxy}/v1/chat/completions", json=body, headers=headers)
        sent.append((rid, outcome))
        # One at a time: each request has ended before the next starts, so the order is known.
        n = len(sent)
        wait_until(lambda: len(ui_data(proxy)["requests"]) >= n, what=f"{rid} to end")  # noqa: B023
    return sent


def bucket_check(text: str, metric: str, model: str, q: float, v: float, n: int) -> None:
    """`v`, the UI's q-quantile by nearest rank, is the k-th smallest of n observations
    (k = ceil(q * n)): the histogram must hold fewer than k at or below the bucket bound under
    `v`, and at least k at or below the bound that `v` falls under."""
    cum: dict[float, float] = {}
    for name, labels, val in samples(text):
        if name == f"{metric}_bucket" and labels.get("model") == model:
            le = float(labels["le"])
            cum[le] = cum.get(le, 0.0) + val
    bounds = sorted(cum)
    k = math.ceil(q * n - 1e-9)
    hi = next(b for b in bounds if v <= b)
    lo_bounds = [b for b in bounds if b < hi]
    below = cum[lo_bounds[-1]] if lo_bounds else 0.0
    assert below < k <= cum[hi], f"{metric} {model} q={q}: {v} not in its bucket ({below}, {cum[hi]}], k={k}"


def test_ui_data_agrees_with_metrics_and_lists_requests(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(settings_for(url)) as proxy, httpx.Client(timeout=10) as client:
        sent = run_workload(client, proxy)
        text = scrape(proxy)
        data = ui_data(proxy)

    # Counts agree exactly.
    totals = data["totals"]
    outcomes = {o for _, o in sent}
    assert set(totals["requests"]) == outcomes
    for outcome in outcomes:
        expected = value(text, "infertap_requests_total", outcome=outcome)
        assert totals["requests"][outcome] == expected == sum(o == outcome for _, o in sent)
    assert totals["retries"] == value(text, "infertap_retries_total") > 0
    for phase, n in totals["timeouts"].items():
        assert n == value(text, "infertap_timeouts_total", phase=phase), phase
    # idle-0 once; ttft-0 (no first token within `idle`) on its retry and at its end
    assert totals["timeouts"]["idle"] == 1 and totals["timeouts"]["ttft"] == 2
    assert totals["prompt_tokens"] == value(text, "infertap_prompt_tokens_total") > 0
    assert totals["completion_tokens"] == value(text, "infertap_completion_tokens_total") > 0
    assert data["in_flight"] == 0 == value(text, "infertap_in_flight_requests")
    minute = data["last_minute"]
    assert sum(minute["requests"].values()) == len(sent)
    assert minute["timeouts"] == 3 and minute["retries"] == totals["retries"]

    # Quantiles per model: the same number of observations, each quantile within its bucket.
    assert set(data["latency"]) >= {"fake-model", "other-model"}
    for model in ("fake-model", "other-model"):
        for kind, metric in (
            ("ttft", "infertap_time_to_first_token_seconds"),
            ("tpot", "infertap_time_per_output_token_seconds"),
        ):
            window = data["latency"][model][kind]["window"]
            n = window["count"]
            assert n == value(text, f"{metric}_count", model=model) > 0, (model, kind)
            for name, q in QS.items():
                bucket_check(text, metric, model, q, window[name], n)
            series = data["latency"][model][kind]
            assert sum(series["count"]) == n
            assert len(series["p50"]) == len(data["series"]["t"])
            assert any(v is not None for v in series["p99"])

    # Rates: each step's requests/s times its length adds up to the requests.
    t = data["series"]["t"]
    assert len(t) == data["window_s"] // data["step_s"] and t == sorted(t)
    per_s = data["series"]["requests_per_s"]
    assert set(per_s) == outcomes

    # The table: every request, newest first, with its outcome; timings where there were some.
    rows = data["requests"]
    assert [(r["request_id"], r["outcome"]) for r in rows] == list(reversed(sent))
    assert [r["time"] for r in rows] == sorted((r["time"] for r in rows), reverse=True)
    by_id = {r["request_id"]: r for r in rows}
    ok = by_id["ok-10"]
    assert ok["ttft"] >= 0.26 and ok["tpot"] is not None and ok["decode"] is not None
    assert ok["ttft"] + ok["decode"] <= ok["duration"]
    assert ok["model"] == "fake-model" and ok["upstream"] == "fake" and ok["completion_tokens"] == 5
    assert by_id["plain-0"]["ttft"] is None and by_id["plain-0"]["stream"] is False
    assert by_id["ttft-0"]["retries"] == 1 and by_id["err-0"]["status"] == 500
    assert by_id["bad-0"]["prompt_tokens"] is None


def test_no_prompt_text_and_no_secret_in_ui_data(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = fake
    monkeypatch.setenv("UI_TEST_UPSTREAM_KEY", "sk-upstream-secret-1")
    monkeypatch.setenv("UI_TEST_METRICS_TOKEN", "metrics-secret-2")
    host = url.removeprefix("http://")
    up = UpstreamSettings(
        name="fake",
        base_url=url,
        api_key_env="UI_TEST_UPSTREAM_KEY",
        headers={"x-extra-token": "header-secret-4", "x-team": "header-secret-5"},
    )
    # Credentials in a URL and a key variable may not be combined (refused at load): a second one.
    basic = UpstreamSettings(name="basic", base_url=f"http://user:pw-secret-3@{host}", models=["basic-*"])
    settings = Settings(
        upstreams=[up, basic],
        auth=AuthSettings(metrics_token_env="UI_TEST_METRICS_TOKEN"),
        timeouts=TimeoutSettings(idle=0.3),
    )
    auth = {"authorization": "Bearer metrics-secret-2"}
    with run_proxy(settings) as proxy, httpx.Client(timeout=10) as client:
        for i, hdr in enumerate(({}, {"x-fake-hang": "after-first"}, {"x-fake-status": "400"})):
            client.post(f"{proxy}/v1/chat/completions", json=chat(), headers={**hdr, "x-request-id": f"r{i}"})
        wait_until(lambda: len(ui_data(proxy, **auth)["requests"]) == 3)
        raw = httpx.get(f"{proxy}/ui/data", headers=auth).text
        data = ui_data(proxy, **auth)
    for secret in (MARKER, "hello", "sk-upstream-secret-1", "metrics-secret-2", "pw-secret-3"):
        assert secret not in raw, secret
    for secret in ("header-secret-4", "header-secret-5", "tok0"):
        assert secret not in raw, secret
    # Names of what holds secrets are shown; the values never.
    rows = {r["name"]: r for r in data["upstreams"]}
    row = rows["fake"]
    assert row["api_key_env"] == "UI_TEST_UPSTREAM_KEY" and row["api_key_set"] is True
    assert row["base_url"] == url and row["state"] == "up"
    assert rows["basic"]["base_url"] == url
    config = data["config"]
    assert config["upstreams"][0]["api_key_env"] == "UI_TEST_UPSTREAM_KEY"
    assert config["upstreams"][0]["headers"] == {"x-extra-token": "(hidden)", "x-team": "(hidden)"}
    assert config["auth"]["metrics_token_env"] == "UI_TEST_METRICS_TOKEN"
    assert config["ui"]["enabled"] is True


def test_circuit_state_follows_upstream_health(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = settings_for(
        url,
        retry=RetrySettings(max_attempts=1),
        circuit=CircuitSettings(failure_threshold=1, cooldown_seconds=600),
    )
    with run_proxy(settings) as proxy, httpx.Client(timeout=10) as client:
        assert ui_data(proxy)["upstreams"][0]["state"] == "up"
        client.post(f"{proxy}/v1/chat/completions", json=chat(), headers={"x-fake-status": "503"})
        wait_until(lambda: ui_data(proxy)["upstreams"][0]["requests"] == {"upstream_error": 1})
        (row,) = ui_data(proxy)["upstreams"]
        assert row["state"] == "circuit_open" and row["since"] is not None
        assert value(scrape(proxy), "infertap_upstream_up", upstream="fake") == 0


def test_table_is_bounded_and_disabled_ui_is_404(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(settings_for(url, ui=UISettings(recent_requests=3))) as proxy, httpx.Client() as c:
        for i in range(5):
            c.post(f"{proxy}/v1/chat/completions", json=chat(), headers={"x-request-id": f"b{i}"})
        wait_until(lambda: ui_data(proxy)["totals"]["requests"].get("ok") == 5)
        assert [r["request_id"] for r in ui_data(proxy)["requests"]] == ["b4", "b3", "b2"]
    with run_proxy(settings_for(url, ui=UISettings(enabled=False))) as proxy, httpx.Client() as c:
        for path in ("/ui", "/ui/", "/ui/data", "/ui/app.js", "/ui/style.css"):
            assert c.get(f"{proxy}{path}").status_code == 404, path
        assert c.get(f"{proxy}/metrics").status_code == 200


def test_ui_section_from_toml(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[ui]\nenabled = false\nwindow_seconds = 120\nstep_seconds = 2\n")
    s = load_settings(config)
    assert s.ui.enabled is False and s.ui.window_seconds == 120
    config.write_text("[ui]\nwindow_seconds = 10\nstep_seconds = 10\n")
    with pytest.raises(ConfigError, match="ui"):
        load_settings(config)


def test_token_required_when_configured(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = fake
    monkeypatch.setenv("UI_TEST_TOKEN", "s3cret-token")
    settings = settings_for(url, auth=AuthSettings(metrics_token_env="UI_TEST_TOKEN"))
    with run_proxy(settings) as proxy, httpx.Client() as c:
        for path in ("/ui", "/ui/data", "/metrics"):
            r = c.get(f"{proxy}{path}")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert c.get(f"{proxy}{path}", headers={"authorization": "Bearer wrong"}).status_code == 401
            assert (
                c.get(f"{proxy}{path}", headers={"authorization": "Bearer s3cret-token"}).status_code == 200
            )
        for path in ("/ui", "/ui/data"):
            assert c.get(f"{proxy}{path}?token=wrong").status_code == 401
            assert c.get(f"{proxy}{path}?token=s3cret-token").status_code == 200
        # The page carries no data and passes its token on; its script and style sheet are public.
        assert c.get(f"{proxy}/ui/app.js").status_code == 200
        redirect = c.get(f"{proxy}/ui/?token=s3cret-token")
        assert redirect.status_code == 308 and redirect.headers["location"] == "../ui?token=s3cret-token"


def test_static_files_and_their_content_types(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(settings_for(url)) as proxy, httpx.Client() as c:
        page = c.get(f"{proxy}/ui")
        js = c.get(f"{proxy}/ui/app.js")
        css = c.get(f"{proxy}/ui/style.css")
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert js.headers["content-type"] == "text/javascript; charset=utf-8"
    assert css.headers["content-type"] == "text/css; charset=utf-8"
    for r in (page, js, css):
        assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    # Relative links (the page also works under a path prefix), nothing from elsewhere.
    assert 'src="ui/app.js"' in page.text and 'href="ui/style.css"' in page.text
    for r in (page, js, css):
        urls = re.findall(r"https?://[^\s\"'`)]+", r.text)
        assert all(u == "http://www.w3.org/2000/svg" for u in urls), urls  # a namespace, not a fetch
    assert 'fetch("ui/data"' in js.text


def test_quantiles_and_rings() -> None:
    rng = random.Random(1)
    values = [rng.random() for _ in range(101)]
    r = Reservoir()
    for v in values:
        r.add(v, 1000, rng)
    n, (p50, p90, p99) = quantiles([r])
    ordered = sorted(values)
    assert n == 101 and (p50, p90, p99) == (ordered[50], ordered[90], ordered[99])
    assert quantiles([]) == (0, [None, None, None])
    # Beyond its cap a reservoir keeps a uniform sample and weighs it by what it stands for.
    big, small = Reservoir(), Reservoir()
    for i in range(10_000):
        big.add(10.0 + i / 10_000, 50, rng)
    small.add(1.0, 50, rng)
    assert len(big.values) == 50 and big.n == 10_000
    n, (p50, _, p99) = quantiles([big, small])
    assert n == 10_001 and p50 is not None and p50 >= 10.0 and p99 is not None and p99 < 11.0
    ring = SecondRing(10)
    ring.at(5).retries += 1
    ring.at(15).retries += 2  # the same slot, a later second: reset first
    assert ring.get(5) is None and ring.at(15).retries == 2
    assert [s.sec for s in ring.span(0, 20)] == [15]


def test_the_only_upstream_is_the_default_as_the_start_up_log_says(fake: tuple[FakeUpstream, str]) -> None:
    """Regression (issue 16): /ui/data said "default": false for the embedded sim, logged [default]."""
    _, url = fake
    with run_proxy(make_settings(("sim", url), ("other", url))) as proxy:
        rows = {row["name"]: row["default"] for row in ui_data(proxy)["upstreams"]}
    assert rows == {"sim": True, "other": False}
