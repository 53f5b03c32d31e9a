"""Who used what and what it cost: named clients, cached and reasoning tokens, the first answer
token of reasoning models, and spend (proxy/control/auth.py, proxy/observe/spend.py, the observers)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.control.auth import ClientKeys
from proxy.core.sse import ResponsesScanner, SSEScanner
from proxy.core.stream_facts import usage_details
from proxy.observe.tracing import TracingObserver
from proxy.settings import AuthSettings, ConfigError, PriceSettings, SpendSettings, load_settings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import RecordingObserver, make_settings, run_proxy, wait_until
from tests.promtext import samples, scrape, value

KEYS = {"alice": "sk-alice-1234", "bob": "sk-bob-5678", "bare": "sk-bare-0000"}
SECRETS = [*KEYS.values(), *(hashlib.sha256(k.encode()).hexdigest() for k in KEYS.values())]
# Known prices: deepseek with a cheaper cached input, qwen with none (cached costs input).
PRICES = [
    PriceSettings(models=["deepseek-*"], input_per_mtok=2.0, cached_input_per_mtok=0.5, output_per_mtok=8.0),
    PriceSettings(models=["qwen-*"], input_per_mtok=1.0, output_per_mtok=3.0),
]


def _chat(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def named(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[str, RecordingObserver, InMemorySpanExporter]]:
    """Two upstreams (deepseek-* to `a`, the rest to `b`), alice and a bare key from the environment,
    bob from the keys file, prices for deepseek and qwen, tracing to memory."""
    _, url = fake
    monkeypatch.setenv("TEST_CLIENT_KEYS", f"alice={KEYS['alice']}, {KEYS['bare']}")
    keys = tmp_path / "keys.sha256"
    keys.write_text(f"# bob's team\n{hashlib.sha256(KEYS['bob'].encode()).hexdigest()} bob\n")
    settings = make_settings(("a", url), ("b", url))
    settings.upstreams[0].models = ["deepseek-*"]
    settings.upstreams[1].default = True
    settings.auth.keys_env = "TEST_CLIENT_KEYS"
    settings.auth.keys_file = str(keys)
    settings.spend = SpendSettings(currency="CNY", prices=PRICES, daily_budget=5.0, budgets={"alice": 10.0})
    spans = InMemorySpanExporter()
    tracer = TracingObserver(settings.tracing, processor=SimpleSpanProcessor(spans))
    rec = RecordingObserver()
    with run_proxy(settings, tracer, rec) as proxy:
        yield proxy, rec, spans


def test_exact_tokens_and_spend_per_client_model_and_upstream(
    named: tuple[str, RecordingObserver, InMemorySpanExporter], caplog: pytest.LogCaptureFixture
) -> None:
    proxy, rec, spans = named
    caplog.set_level(logging.INFO)
    plan = [  # (client, model, stream, events, prompt, cached, reasoning, count)
        ("alice", "deepseek-chat", True, 4, 1000, 600, 5, 3),
        ("bob", "qwen-7b", False, 3, 200, 50, 0, 2),
        ("bob", "mystery-model", True, 5, 7, 0, 0, 2),
        ("bare", "deepseek-chat", False, 2, 100, 0, 0, 1),
    ]
    n = 0
    with httpx.Client() as c:
        for client, model, stream, events, prompt, cached, reasoning, count in plan:
            for _ in range(count):
                headers = {
                    "authorization": f"Bearer {KEYS[client]}",
                    "x-request-id": f"req-{n}",
                    "x-fake-events": str(events),
                    "x-fake-prompt-tokens": str(prompt),
                    "x-fake-reasoning": str(reasoning),
                }
                if cached:
                    headers["x-fake-cached"] = str(cached)
                r = c.post(f"{proxy}/v1/chat/completions", json=_chat(model, stream), headers=headers)
                assert r.status_code == 200
                n += 1
        wait_until(lambda: sum(rec.terminal_count(r) for r in rec.exchanges) == n)
        text = scrape(proxy)
    alice = {"client": "alice", "model": "deepseek-chat", "upstream": "a"}
    bob = {"client": "bob", "model": "qwen-7b", "upstream": "b"}
    assert value(text, "infertap_requests_total", outcome="ok", **alice) == 3
    assert value(text, "infertap_requests_total", outcome="ok", **bob) == 2
    assert value(text, "infertap_requests_total", client="unnamed") == 1
    assert value(text, "infertap_prompt_tokens_total", **alice) == 3 * 1000
    assert value(text, "infertap_cached_prompt_tokens_total", **alice) == 3 * 600
    assert value(text, "infertap_completion_tokens_total", **alice) == 3 * (4 + 5)
    assert value(text, "infertap_reasoning_tokens_total", **alice) == 3 * 5
    assert value(text, "infertap_prompt_tokens_total", **bob) == 2 * 200
    assert value(text, "infertap_cached_prompt_tokens_total", **bob) == 2 * 50
    assert value(text, "infertap_reasoning_tokens_total", **bob) == 0
    # (uncached x input + cached x cached_input + completion x output) / 1e6
    alice_cost = (400 * 2.0 + 600 * 0.5 + 9 * 8.0) / 1e6
    bob_cost = (150 * 1.0 + 50 * 1.0 + 3 * 3.0) / 1e6  # no cached price: cached costs input
    bare_cost = (100 * 2.0 + 2 * 8.0) / 1e6
    assert value(text, "infertap_spend_total", **alice) == pytest.approx(3 * alice_cost, rel=1e-12)
    assert value(text, "infertap_spend_total", **bob) == pytest.approx(2 * bob_cost, rel=1e-12)
    assert value(text, "infertap_spend_total", client="unnamed", upstream="a") == pytest.approx(bare_cost)
    assert value(text, "infertap_spend_total", model="mystery-model") == 0
    assert value(text, "infertap_unpriced_tokens_total", model="mystery-model", upstream="b") == 2 * (7 + 5)
    assert value(text, "infertap_spend_daily_budget", client="alice") == 10.0
    assert value(text, "infertap_spend_daily_budget", client="bob") == 5.0  # the default

    # The access log tells the same per-request figures.
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "infertap.access"]
    assert len(lines) == n
    by_id = {ln["request_id"]: ln for ln in lines}
    for i in range(3):
        ln = by_id[f"req-{i}"]
        assert ln["client"] == "alice" and ln["upstream"] == "a"
        assert (ln["prompt_tokens"], ln["cached_tokens"], ln["completion_tokens"]) == (1000, 600, 9)
        assert ln["reasoning_tokens"] == 5 and ln["cost"] == pytest.approx(alice_cost, rel=1e-9)
    assert by_id["req-3"]["cost"] == pytest.approx(bob_cost, rel=1e-9) and by_id["req-3"]["client"] == "bob"
    assert "cost" not in by_id["req-5"] or by_id["req-5"]["cost"] is None  # unpriced
    assert sum(ln["cost"] or 0 for ln in lines) == pytest.approx(
        value(text, "infertap_spend_total"), rel=1e-9
    )
    # The unpriced model is flagged once, however often it comes.
    flagged = [r for r in caplog.records if r.name == "infertap.spend" and "mystery-model" in r.getMessage()]
    assert len(flagged) == 1

    # Spans carry the client name and the same cost.
    servers = {
        s.attributes["infertap.request_id"]: s.attributes
        for s in spans.get_finished_spans()
        if s.kind.name == "SERVER" and s.attributes
    }
    assert servers["req-0"]["infertap.client"] == "alice"
    assert servers["req-0"]["infertap.cost"] == pytest.approx(alice_cost, rel=1e-12)
    assert servers["req-0"]["gen_ai.usage.cache_read.input_tokens"] == 600
    assert servers["req-0"]["infertap.usage.reasoning_tokens"] == 5

    # No key, no hash and no Authorization header value in any label, log line or span.
    everything = text + "\n".join(r.getMessage() for r in caplog.records)
    everything += "".join(json.dumps(dict(s.attributes or {})) for s in spans.get_finished_spans())
    everything += "".join(str(e.attributes) for s in spans.get_finished_spans() for e in s.events)
    for secret in SECRETS:
        assert secret not in everything
    assert "Bearer" not in everything
    clients = {lab["client"] for nm, lab, _ in samples(text) if "client" in lab}
    assert clients == {"alice", "bob", "unnamed"}


def test_a_wrong_key_is_refused_and_counted_nowhere(
    named: tuple[str, RecordingObserver, InMemorySpanExporter],
) -> None:
    proxy, rec, _ = named
    r = httpx.post(
        f"{proxy}/v1/chat/completions",
        json=_chat("deepseek-chat", False),
        headers={"authorization": "Bearer sk-alice-123", "x-infertap-client": "mallory"},
    )
    assert r.status_code == 401 and not rec.exchanges
    text = scrape(proxy)
    assert "mallory" not in text and "sk-alice" not in text


def test_trusted_header_names_clients_within_the_cap(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = make_settings(("fake", url))
    settings.metrics.access_log = False
    settings.ui.enabled = False
    settings.clients.header = "X-Infertap-Client"
    cap = settings.clients.max_clients
    with run_proxy(settings) as proxy, httpx.Client() as c:
        for i in range(1000):
            c.post(
                f"{proxy}/v1/chat/completions",
                json=_chat("fake-model", False),
                headers={"x-infertap-client": f"team-{i}"},
            )
        c.post(f"{proxy}/v1/chat/completions", json=_chat("fake-model", False))  # no header
        text = scrape(proxy)
    clients = {lab["client"] for nm, lab, _ in samples(text) if nm == "infertap_requests_total"}
    assert len(clients) <= cap + 2 and {"other", "anonymous", "team-0"} <= clients
    assert "team-999" not in clients
    assert value(text, "infertap_requests_total") == 1001
    assert value(text, "infertap_requests_total", client="other") == 1000 - cap


def test_the_header_is_ignored_unless_configured_and_odd_values_are_other(
    fake: tuple[FakeUpstream, str],
) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        httpx.post(
            f"{proxy}/v1/chat/completions", json=_chat("m", False), headers={"x-infertap-client": "eve-zz9"}
        )
        text = scrape(proxy)
    assert value(text, "infertap_requests_total", client="anonymous") == 1 and "eve-zz9" not in text

    settings = make_settings(("fake", url))
    settings.clients.header = "X-Team"
    odd = ["a b", "x" * 65, 'q"uote', "anonymous", "other", "unnamed"]
    with run_proxy(settings) as proxy, httpx.Client() as c:
        for v in odd:
            c.post(f"{proxy}/v1/chat/completions", json=_chat("m", False), headers={"x-team": v})
        text = scrape(proxy)
    clients = {lab["client"] for nm, lab, _ in samples(text) if nm == "infertap_requests_total"}
    assert clients == {"other"}


def test_reasoning_stream_has_two_first_token_times(
    fake: tuple[FakeUpstream, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, url = fake
    caplog.set_level(logging.INFO, logger="infertap.access")
    rec = RecordingObserver()
    spans = InMemorySpanExporter()
    settings = make_settings(("fake", url))
    tracer = TracingObserver(settings.tracing, processor=SimpleSpanProcessor(spans))
    answer_ms = 400
    with run_proxy(settings, tracer, rec) as proxy, httpx.Client() as c:
        r = c.post(
            f"{proxy}/v1/chat/completions",
            json=_chat("fake-model", True),
            headers={
                "x-request-id": "think",
                "x-fake-reasoning": "3",
                "x-fake-answer-ms": str(answer_ms),
                "x-fake-events": "4",
            },
        )
        assert r.status_code == 200 and b"reasoning_content" in r.content
        c.post(
            f"{proxy}/v1/chat/completions", json=_chat("fake-model", True), headers={"x-request-id": "plain"}
        )
        think, plain = rec.wait_terminal("think"), rec.wait_terminal("plain")
        text = scrape(proxy)
    assert think.first_token_at is not None and think.first_answer_at is not None
    assert think.ttft is not None and think.ttft_answer is not None
    # The scripted pause separates them: far more than scheduling noise, at most the whole request.
    gap = think.ttft_answer - think.ttft
    assert answer_ms / 1000 / 10 < gap and think.ttft_answer < (think.duration or 0)
    assert think.output_events == 3 + 4 and think.reasoning_tokens == 3
    assert plain.ttft_answer == plain.ttft  # no reasoning: the first token is the answer
    lines = {ln["request_id"]: ln for ln in (json.loads(r.getMessage()) for r in caplog.records)}
    assert lines["think"]["ttft_answer_s"] == pytest.approx(think.ttft_answer, abs=1e-6)
    assert lines["think"]["ttft_s"] == pytest.approx(think.ttft, abs=1e-6)
    assert value(text, "infertap_time_to_first_answer_token_seconds_count") == 2
    assert value(text, "infertap_time_to_first_answer_token_seconds_sum") == pytest.approx(
        think.ttft_answer + (plain.ttft_answer or 0), abs=1e-6
    )
    server = next(
        s
        for s in spans.get_finished_spans()
        if s.kind.name == "SERVER" and (s.attributes or {}).get("infertap.request_id") == "think"
    )
    assert server.attributes is not None and server.attributes["infertap.ttft_answer_s"] == think.ttft_answer
    names = [e.name for e in server.events]
    assert names.index("first_token") < names.index("first_answer_token")


def _feed_events(scanner: SSEScanner, events: list[bytes]) -> list[bool]:
    """Feeds one event at a time; `answered` after each."""
    seen = []
    for e in events:
        scanner.feed(e)
        seen.append(scanner.facts.answered)
    return seen


def _chat_event(delta: dict[str, Any]) -> bytes:
    obj = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_scanner_finds_the_first_answer_after_reasoning() -> None:
    events = [
        _chat_event({"role": "assistant", "content": ""}),
        _chat_event({"content": None, "reasoning_content": 'I think "content": "x" is'}),
        _chat_event({"content": "", "reasoning": "hmm"}),
        _chat_event({"content": "Answer"}),
        _chat_event({"content": "more"}),
    ]
    assert _feed_events(SSEScanner(), events) == [False, False, False, True, True]
    tools = [_chat_event({"reasoning_content": "x"}), _chat_event({"tool_calls": [{"index": 0}]})]
    assert _feed_events(SSEScanner(), tools) == [False, True]


def test_responses_scanner_finds_the_first_answer_after_reasoning_events() -> None:
    def ev(kind: str, delta: str) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'delta': delta})}\n\n".encode()

    events = [
        ev("response.reasoning_summary_text.delta", "Let me"),
        ev("response.reasoning_text.delta", " think"),
        ev("response.output_text.delta", "Hi"),
    ]
    scanner = ResponsesScanner()
    assert _feed_events(scanner, events) == [False, False, True]


def test_usage_details_of_both_apis() -> None:
    chat = {
        "prompt_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    responses = {
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens_details": {"reasoning_tokens": 1},
    }
    assert usage_details(chat) == (4, 3)
    assert usage_details(responses) == (2, 1)
    assert usage_details({"prompt_tokens": 1, "prompt_tokens_details": None}) == (None, None)


def test_key_names_from_the_environment_and_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("K", "ci=sk-1, sk-2==, web-app=sk=3")
    keys = tmp_path / "keys"
    four, five = (hashlib.sha256(k).hexdigest() for k in (b"sk-4", b"sk-5"))
    keys.write_text(f"{four}   ops-team  # comment\n{five}\n")
    ck = ClientKeys.from_settings(AuthSettings(keys_env="K", keys_file=str(keys)))
    assert ck is not None
    assert [ck.identify(f"Bearer {k}") for k in ("sk-1", "sk-2==", "sk=3", "sk-4", "sk-5", "sk-6")] == [
        "ci",
        "unnamed",
        "web-app",
        "ops-team",
        "unnamed",
        None,
    ]
    assert ck.identify("Bearer sk-1") is not None and ck.identify("sk-1") is None


@pytest.mark.parametrize("entry", ["anonymous=sk-1", "other=sk-1"])
def test_reserved_names_are_refused(monkeypatch: pytest.MonkeyPatch, entry: str) -> None:
    monkeypatch.setenv("K", entry)
    with pytest.raises(ConfigError, match="client name"):
        ClientKeys.from_settings(AuthSettings(keys_env="K"))


def test_a_bad_name_in_the_keys_file_names_the_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{hashlib.sha256(b'x').hexdigest()} has space\n")
    with pytest.raises(ConfigError, match=":1: client name"):
        ClientKeys.from_settings(AuthSettings(keys_file=str(keys)))


def test_spend_config_in_the_documented_form(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        """
[spend]
currency = "CNY"
[[spend.prices]]
models = ["deepseek-*"]        # globs on the requested model; the first match wins
input_per_mtok = 2.0           # per million prompt tokens not served from cache
cached_input_per_mtok = 0.5    # per million cached prompt tokens (defaults to input_per_mtok)
output_per_mtok = 8.0          # per million completion tokens, reasoning included
"""
    )
    spend = load_settings(config).spend
    assert spend.currency == "CNY" and spend.prices[0].models == ["deepseek-*"]
    assert spend.prices[0].cached_input_per_mtok == 0.5
    config.write_text('[spend]\n[[spend.prices]]\nmodels = ["x"]\ninput_per_mtok = -1\noutput_per_mtok = 1\n')
    with pytest.raises(ConfigError, match="spend.prices.0.input_per_mtok"):
        load_settings(config)


def test_the_example_config_shows_the_spend_form_with_example_numbers(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    lines = (root / "config.example.toml").read_text().splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("# [spend]")))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("# "):
            break
        block.append(ln[2:])
    assert all("example" in ln.lower() for ln in block if "_per_mtok" in ln)
    config = tmp_path / "config.toml"
    config.write_text("\n".join(block) + "\n")
    spend = load_settings(config).spend
    assert spend.prices and spend.prices[0].output_per_mtok == 8.0 and spend.budgets == {"ci": 10.0}
    load_settings(root / "config.example.toml")
