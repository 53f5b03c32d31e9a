"""Loop detection: the repetition score on texts, and the observer end to end through infertap and the
simulated engine (whose greedy, unpenalised decoding repeats a phrase)."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from proxy.core.exchange import Exchange
from proxy.observe.repetition import RepetitionDetector, repetition_score, tokens
from proxy.settings import LoopSettings, Settings
from proxy.sim import create_sim_app
from proxy.sim.config import sim_config_from_dict
from proxy.sim.sampling import VOCABULARY
from tests.conftest import make_settings, run_proxy, serve_in_thread
from tests.promtext import scrape, value

PROSE = [
    "Prefill reads every prompt token in parallel and builds the key and value tensors that decoding "
    "needs later. Its cost grows with the prompt, which is why a long document makes the first token "
    "arrive late even on an idle machine. Decode is different: it produces one token at a time, and "
    "each step reads the cache instead of recomputing the history, so the time per token stays flat "
    "as long as the cache is working and the batch is not overloaded by other requests.",
    "The proxy relays every chunk the moment it arrives and records when the first piece of text was "
    "handed to the client. That moment, not the first byte, is what a user perceives as the start of "
    "an answer, because most servers send a role-only delta before any content. Retries happen only "
    "before the response headers go out; afterwards an upstream failure becomes an error event in "
    "the stream, so a client never mistakes a truncated answer for a complete one.",
    "def percentile(values, q):\n    xs = sorted(values)\n    pos = (len(xs) - 1) * q / 100\n"
    "    lo = math.floor(pos)\n    hi = min(lo + 1, len(xs) - 1)\n    return xs[lo] + (xs[hi] - "
    "xs[lo]) * (pos - lo)\n\nThe function interpolates linearly between the closest ranks, which is "
    "numpy's default method, so the median of an even-sized list is the mean of its middle pair.",
    "预填充阶段并行读取提示中的每一个词元，并建立键值缓存。提示越长，首个词元出现得越晚。解码阶段则每次只生成一个"
    "词元，从缓存中读取历史而不是重新计算，所以只要缓存正常工作，每个词元的耗时基本保持稳定。如果关闭缓存，"
    "每一步都要重新计算全部历史，生成速度会随着上下文变长而明显下降。",
]
SETTINGS = LoopSettings()


def score(text: str) -> float | None:
    return repetition_score(text, SETTINGS.ngram, SETTINGS.min_tokens)


@pytest.mark.parametrize("text", PROSE)
def test_varied_text_scores_low(text: str) -> None:
    s = score(text)
    assert s is not None and s < 0.1 < SETTINGS.threshold


def test_random_vocabulary_text_never_scores_high() -> None:
    # The simulated engine's normal output: varied words; 200 answers, none near the threshold.
    rng = random.Random(1)
    for _ in range(200):
        text = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(40, 400)))
        s = score(text)
        assert s is not None and s < 0.1


@pytest.mark.parametrize(
    "text",
    [
        "The answer is simple. " + "I am not sure. " * 30,
        "Here is the list:\n" + "- the same item again\n" * 20,
        "好的，我来回答。" + "这是一个重复的句子。" * 20,
        "Let me explain prefill first. " + "Prefill reads the prompt and builds the cache, then " * 12,
    ],
)
def test_a_repeated_phrase_scores_high(text: str) -> None:
    s = score(text)
    assert s is not None and s >= SETTINGS.threshold


def test_short_texts_are_ignored() -> None:
    assert score("ok ok ok ok ok ok") is None
    assert score("") is None
    assert score("yes. " * (SETTINGS.min_tokens // 2 - 1)) is None  # "yes" "." a repeat: still too short
    assert repetition_score("a b c d e f", ngram=2, min_tokens=3) == 0.0


def test_tokens_are_words_and_cjk_characters() -> None:
    assert tokens("Hello, world!  你好，OK") == ["hello,", "world!", "你", "好", "，", "ok"]


def test_the_observer_asks_for_the_window_and_scores_once() -> None:
    flagged: list[tuple[str, float]] = []
    det = RepetitionDetector(LoopSettings(window_chars=500), lambda ex, s: flagged.append((ex.request_id, s)))
    ex = Exchange(request_id="r1", route="chat.completions", method="POST", path="/v1/chat/completions")
    ex.capture_output_chars = 4096  # another observer (tracing) asked for more: keep the larger
    det.request_received(ex)
    assert ex.capture_output_chars == 4096
    ex.output_text = "Once upon a time. " + "We go round and round. " * 40
    det.ended(ex)
    assert [r for r, _ in flagged] == ["r1"] and flagged[0][1] >= 0.5
    emb = Exchange(request_id="r2", route="embeddings", method="POST", path="/v1/embeddings")
    det.request_received(emb)
    assert emb.capture_output_chars == 0  # nothing to read in an embedding
    varied = Exchange(request_id="r3", route="completions", method="POST", path="/v1/completions")
    det.request_received(varied)
    assert varied.capture_output_chars == 500
    varied.output_text = PROSE[0]
    det.ended(varied)
    assert len(flagged) == 1


def test_off_by_default() -> None:
    assert Settings().loops.enabled is False


# -- end to end ----------------------------------------------------------------------------------
FAST = {"prefill_base_ms": 1.0, "prefill_ms_per_token": 0.01, "decode_step_ms": 1.0,
        "decode_ms_per_running_seq": 0.05, "default_output_tokens": 80}  # fmt: skip
LOOPING = {"temperature": 0.0, "repetition_penalty": 1.0}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


def test_counter_increments_only_for_looping_answers() -> None:
    engine_app = create_sim_app(sim_config_from_dict({"sim": FAST}))  # decode defaults: 0.7, 1.05
    with serve_in_thread(engine_app) as engine:
        settings = make_settings(("sim", engine + "/v1"), loops=LoopSettings(enabled=True))
        with run_proxy(settings) as proxy, httpx.Client(timeout=30) as c:
            url = f"{proxy}/v1/chat/completions"
            for i in range(12):  # varied answers, streamed and not, with and without usage
                extra: dict[str, Any] = {"stream": i % 2 == 0, "seed": i}
                if i % 4 == 0:
                    extra["stream_options"] = {"include_usage": True}
                r = c.post(url, json=chat(f"question {i}", **extra))
                assert r.status_code == 200
            assert value(scrape(proxy), "infertap_degenerate_responses_total") == 0
            # Greedy and unpenalised: the sim repeats one phrase. Streamed, then not.
            r = c.post(url, json=chat("loop please", stream=True, **LOOPING))
            assert r.status_code == 200 and r.text.count("data:") > 80
            text = scrape(proxy)
            assert value(text, "infertap_degenerate_responses_total", model="sim-model") == 1
            r = c.post(url, json=chat("loop again", **LOOPING))
            answer = r.json()["choices"][0]["message"]["content"]
            assert (score(answer) or 0) >= SETTINGS.threshold
            assert value(scrape(proxy), "infertap_degenerate_responses_total", model="sim-model") == 2
            # A short greedy answer is not judged.
            c.post(url, json=chat("brief", stream=True, max_tokens=10, **LOOPING))
            assert value(scrape(proxy), "infertap_degenerate_responses_total") == 2


def test_disabled_detector_counts_nothing() -> None:
    engine_app = create_sim_app(sim_config_from_dict({"sim": FAST}))
    with serve_in_thread(engine_app) as engine:
        with run_proxy(make_settings(("sim", engine + "/v1"))) as proxy:
            r = httpx.post(f"{proxy}/v1/chat/completions", json=chat("loop", stream=True, **LOOPING))
            assert r.status_code == 200
            text = scrape(proxy)
    assert value(text, "infertap_degenerate_responses_total") == 0
    assert "# TYPE infertap_degenerate_responses_total counter" in text
