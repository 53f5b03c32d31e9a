"""`infertap compare` (the seed's A/B experiment) and the statistics behind it."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.sim import create_sim_app
from proxy.sim.config import sim_config_from_dict
from proxy.tools.probe import compare
from proxy.tools.probe.stats import RatioCI, bootstrap_ratio_ci, percentile, summarize
from tests.conftest import serve_in_thread
from tests.test_probe import closed_port, engine, run_probe

# Each request's TTFT and TPOT vary by +-30% (as real ones do), so the CI has honest width.
JITTER = 0.3


def run_compare(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = compare.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# -- acceptance --------------------------------------------------------------------------------


def test_b_with_three_times_the_tpot_is_called_out(capsys: pytest.CaptureFixture[str]) -> None:
    # The seed's experiment: B is "the KV cache off", decoding ~3x slower; prefill unchanged.
    with (
        engine(ttft_s=0.04, tpot_s=0.010, tokens=12, jitter=JITTER, seed=1) as (_, url_a),
        engine(ttft_s=0.04, tpot_s=0.030, tokens=12, jitter=JITTER, seed=2) as (_, url_b),
    ):
        code, out, err = run_compare(
            capsys, "--a", url_a, "--b", url_b, "--model", "m", "-n", "12", "-c", "4", "--json"
        )
    assert code == 0, err
    report = json.loads(out)
    tpot = report["metrics"]["tpot_s"]
    assert tpot["significant"] is True
    assert tpot["ci_low"] > 1.0, tpot  # the CI excludes 1x
    assert 1.5 < tpot["ratio_b_over_a"] < 4.5 and tpot["ci_low"] <= tpot["ratio_b_over_a"] <= tpot["ci_high"]
    assert tpot["verdict"].startswith("TPOT ") and "× higher in B, 95% CI " in tpot["verdict"]
    assert report["a"]["ok"] == report["b"]["ok"] == 12
    assert report["bootstrap"] == {"statistic": "median", "resamples": 2000, "confidence": 0.95, "seed": 0}


def test_two_identical_targets_show_no_clear_difference(capsys: pytest.CaptureFixture[str]) -> None:
    # An A/A run: two identical engines (same config, same seed), so any "difference" would be
    # the measurement's own doing.
    with (
        engine(ttft_s=0.10, tpot_s=0.010, tokens=12, jitter=JITTER, seed=3) as (_, url_a),
        engine(ttft_s=0.10, tpot_s=0.010, tokens=12, jitter=JITTER, seed=3) as (_, url_b),
    ):
        code, out, err = run_compare(
            capsys, "--a", url_a, "--b", url_b, "--model", "m", "-n", "12", "-c", "4"
        )
    assert code == 0, err
    verdicts = out.split("verdict:")[1]
    assert "TPOT: no clear difference (B/A " in verdicts
    assert "TTFT: no clear difference (B/A " in verdicts


# -- acceptance, issue 7: the seed's KV-cache experiment on the simulated engine ----------------

# Small timing constants (a decode step ~3 ms), so a whole comparison takes a few seconds. With
# the KV cache off every decode step also pays 0.006 ms per token of context of each decoding
# sequence, which the long prompts below make plain (~2.5 ms more per step at 400 tokens).
SIM_TIMING = {
    "prefill_base_ms": 1.0,
    "prefill_ms_per_token": 0.01,
    "decode_step_ms": 3.0,
    "decode_ms_per_running_seq": 0.1,
    "no_kv_cache_ms_per_context_token": 0.006,
    "default_output_tokens": 16,
    "seed": 5,
}
SIM_REQUESTS = 12
# One distinct prompt per request (so no request hits the prefix cache of the one before), of
# 400 to 1000 tokens. With chunked prefill (128 tokens a step), a request that finished its
# prefill early decodes alongside the others' prefill chunks: TPOT differs from request to
# request by its place in the round, the same way on both sides. That spread gives the A/A
# interval an honest width.
SIM_PROMPTS = [f"request {i}: " + "word " * (400 + 200 * (i % 4)) for i in range(SIM_REQUESTS)]


@contextmanager
def sim_engine(kv_cache: bool) -> Iterator[str]:
    """The simulated engine (KV cache on or off) on 127.0.0.1; yields its base URL (ending in /v1)."""
    config = sim_config_from_dict(
        {"sim": SIM_TIMING, "kv_cache": {"enable": kv_cache}, "prefill": {"max_prefill_tokens": 128}}
    )
    with serve_in_thread(create_sim_app(config)) as url:
        base = url + "/v1"
        # Warm-up: the first stream of the process pays one-off lazy imports; keep it out of A.
        hi = {"model": "sim-model", "stream": True, "max_tokens": 1,
              "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        httpx.post(f"{base}/chat/completions", json=hi).raise_for_status()
        yield base


def sim_compare(capsys: pytest.CaptureFixture[str], url_a: str, url_b: str) -> dict[str, Any]:
    prompts = [arg for p in SIM_PROMPTS for arg in ("--prompt", p)]
    code, out, err = run_compare(
        capsys, "--a", url_a, "--b", url_b, "--model", "sim-model", "-n", str(SIM_REQUESTS), "-c", "4",
        "--max-tokens", "16", "--json", *prompts,
    )  # fmt: skip
    assert code == 0, err
    report: dict[str, Any] = json.loads(out)
    assert report["a"]["ok"] == report["b"]["ok"] == SIM_REQUESTS
    assert {r["output_tokens"] for side in "ab" for r in report[side]["results"]} == {16}
    return report


def test_sim_kv_cache_off_raises_tpot_beyond_doubt(capsys: pytest.CaptureFixture[str]) -> None:
    with sim_engine(kv_cache=True) as url_a, sim_engine(kv_cache=False) as url_b:
        report = sim_compare(capsys, url_a, url_b)
    tpot = report["metrics"]["tpot_s"]
    assert tpot["significant"] is True
    assert tpot["ci_low"] > 1.0, tpot  # the 95% CI excludes 1x: TPOT is higher without the KV cache
    assert tpot["ci_low"] <= tpot["ratio_b_over_a"] <= tpot["ci_high"]
    assert tpot["verdict"].startswith("TPOT ") and "× higher in B, 95% CI " in tpot["verdict"]


def test_sim_same_config_on_both_sides_shows_no_clear_difference(capsys: pytest.CaptureFixture[str]) -> None:
    with sim_engine(kv_cache=True) as url_a, sim_engine(kv_cache=True) as url_b:
        report = sim_compare(capsys, url_a, url_b)
    for key in ("tpot_s", "ttft_s"):
        m = report["metrics"][key]
        assert m["significant"] is False, m
        assert m["ci_low"] <= 1.0 <= m["ci_high"], m  # the 95% CI includes 1x
        assert "no clear difference (B/A " in m["verdict"]


def test_one_engine_under_two_configs_run_in_turn(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # The engine is probed, restarted with the KV cache off, probed again; compare reads both runs.
    prompts = [arg for p in SIM_PROMPTS for arg in ("--prompt", p)]
    for name, kv in (("on", True), ("off", False)):
        with sim_engine(kv_cache=kv) as url:
            code, out, err = run_probe(
                capsys, "--base-url", url, "--model", "sim-model", "-n", str(SIM_REQUESTS), "-c", "4",
                "--max-tokens", "16", "--json", *prompts,
            )  # fmt: skip
        assert code == 0, err
        (tmp_path / f"{name}.json").write_text(out)
    runs = [str(tmp_path / "on.json"), str(tmp_path / "off.json")]
    code, out, err = run_compare(capsys, "--runs", *runs, "--label-a", "on", "--label-b", "off", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["a"] == json.loads((tmp_path / "on.json").read_text())  # the saved run, as it was
    tpot = report["metrics"]["tpot_s"]
    assert tpot["ci_low"] > 1.0 and tpot["verdict"].startswith("TPOT ") and "higher in off" in tpot["verdict"]
    code, text, _ = run_compare(capsys, "--runs", *runs)
    assert code == 0 and "verdict:" in text and "TPOT " in text


def test_runs_that_are_not_probe_output_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"target": {}, "summary": {}, "results": []}))
    (tmp_path / "text.json").write_text("TTFT 0.2 s")
    (tmp_path / "other.json").write_text(json.dumps({"requests": 3}))
    (tmp_path / "bad.json").write_text(json.dumps({"target": {}, "summary": {}, "results": [{"nope": 1}]}))
    for name, message in (
        ("missing.json", "cannot read"),
        ("text.json", "not JSON"),
        ("other.json", "not the output of `infertap probe --json`"),
        ("bad.json", "a result is malformed"),
    ):
        code, _, err = run_compare(capsys, "--runs", str(tmp_path / name), str(good))
        assert code == 2 and message in err, (name, err)
    code, _, err = run_compare(capsys, "--runs", str(good), str(good), "--a", "http://x/v1")
    assert code == 2 and "leave out --a" in err


def test_json_report_schema(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.02, tpot_s=0.005, tokens=4, jitter=JITTER) as (app, url):
        code, out, _ = run_compare(
            capsys, "--a", url, "--model-a", "x", "--model-b", "y", "-n", "4", "-c", "2", "--json",
            "--label-a", "cache-on", "--label-b", "cache-off", "--bootstrap", "500", "--seed", "7",
        )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"labels", "a", "b", "bootstrap", "metrics"}
    assert report["labels"] == {"a": "cache-on", "b": "cache-off"}
    assert report["bootstrap"]["resamples"] == 500 and report["bootstrap"]["seed"] == 7
    for side, model in (("a", "x"), ("b", "y")):
        run = report[side]
        assert run["target"]["model"] == model and run["target"]["base_url"] == url
        assert run["requests"] == 4 and run["ok"] == 4 and len(run["results"]) == 4
        assert set(run["summary"]) == {"ttft_s", "tpot_s", "total_s", "tps", "output_tokens"}
    assert set(report["metrics"]) == {"ttft_s", "tpot_s", "total_s"}
    for m in report["metrics"].values():
        assert set(m) == {"ratio_b_over_a", "ci_low", "ci_high", "significant", "verdict"}
    # The same prompt set went to both, interleaved in rounds of C: A A B B A A B B.
    assert [b["model"] for b in app.bodies] == ["x", "x", "y", "y"] * 2
    assert "cache-off" in report["metrics"]["tpot_s"]["verdict"]


def test_two_models_on_one_url(capsys: pytest.CaptureFixture[str]) -> None:
    tpots = {"small": 0.008, "large": 0.024}
    with engine(ttft_s=0.03, tokens=10, jitter=JITTER, tpot_for_model=tpots) as (_, url):
        code, out, _ = run_compare(
            capsys, "--base-url", url, "--model-a", "small", "--model-b", "large", "-n", "10", "-c", "5"
        )
    assert code == 0
    assert "TPOT " in out and "× higher in B, 95% CI" in out
    assert "model: small" in out and "model: large" in out


def test_an_unreachable_side_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(tokens=3) as (_, url):
        dead = f"http://127.0.0.1:{closed_port()}/v1"
        code, out, err = run_compare(
            capsys, "--a", url, "--b", dead, "--model", "m", "-n", "2", "--retries", "0"
        )
    assert code == 1
    assert "not enough successful requests" in out
    assert "2 of 4 requests failed" in err and "cannot connect" in err


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_compare(capsys, "--confidence", "1.5")[0] == 2
    code, _, err = run_compare(capsys, "--a", "not-a-url")
    assert code == 2 and "http:// or https://" in err


# -- verdict wording ---------------------------------------------------------------------------


def test_verdict_wording() -> None:
    higher = RatioCI(ratio=3.1, low=2.8, high=3.4, confidence=0.95, resamples=100)
    assert compare.verdict("TPOT", higher) == "TPOT 3.1× higher in B, 95% CI 2.8–3.4×"
    lower = RatioCI(ratio=0.5, low=0.4, high=0.625, confidence=0.95, resamples=100)
    assert compare.verdict("TTFT", lower) == "TTFT 2.00× lower in B, 95% CI 1.60–2.50×"
    same = RatioCI(ratio=1.02, low=0.95, high=1.1, confidence=0.95, resamples=100)
    assert compare.verdict("TTFT", same) == "TTFT: no clear difference (B/A 1.02×, 95% CI 0.95–1.10×)"
    assert "not enough" in compare.verdict("TPOT", None)


# -- stats -------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy_linear() -> None:
    xs = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(xs, 0) == 15 and percentile(xs, 100) == 50
    assert percentile(xs, 50) == 35
    assert percentile(xs, 40) == pytest.approx(29.0)  # numpy.percentile(xs, 40) == 29.0
    assert percentile(xs, 90) == pytest.approx(46.0)
    assert percentile([3.0], 99) == 3.0
    assert percentile([2.0, 1.0], 50) == 1.5  # unsorted input
    rng = random.Random(5)
    data = [rng.random() for _ in range(101)]
    assert percentile(data, 50) == statistics.median(data)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summarize() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s == {"n": 4, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97),
                 "mean": 2.5, "min": 1.0, "max": 4.0}  # fmt: skip
    assert summarize([]) is None


def test_bootstrap_is_seeded_and_brackets_the_ratio() -> None:
    rng = random.Random(1)
    a = [rng.gauss(10, 1) for _ in range(30)]
    b = [3 * rng.gauss(10, 1) for _ in range(30)]
    ci = bootstrap_ratio_ci(a, b, seed=42)
    assert ci == bootstrap_ratio_ci(a, b, seed=42)  # reproducible
    assert ci != bootstrap_ratio_ci(a, b, seed=43)
    assert ci.low <= ci.ratio <= ci.high and not ci.includes_one
    assert 2.5 < ci.low and ci.high < 3.5
    assert ci.ratio == pytest.approx(statistics.median(b) / statistics.median(a))
    assert ci.confidence == 0.95 and ci.resamples == 2000


def test_bootstrap_of_one_population_includes_one() -> None:
    rng = random.Random(2)
    pop = [rng.lognormvariate(0, 0.3) for _ in range(40)]
    ci = bootstrap_ratio_ci(pop[:20], pop[20:], resamples=1000)
    assert ci.includes_one
    wider = bootstrap_ratio_ci(pop[:20], pop[20:], resamples=1000, confidence=0.99)
    assert wider.low <= ci.low and wider.high >= ci.high


def test_bootstrap_exact_scaling() -> None:
    a = [1.0, 2.0, 3.0]
    ci = bootstrap_ratio_ci(a, [3 * x for x in a], resamples=200)
    assert ci.ratio == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("a", "b", "kwargs"),
    [
        ([1.0], [1.0, 2.0], {}),
        ([0.0, 0.0], [1.0, 2.0], {}),
        ([1.0, 2.0], [1.0, 2.0], {"resamples": 0}),
        ([1.0, 2.0], [1.0, 2.0], {"confidence": 1.0}),
    ],
)
def test_bootstrap_rejects_bad_input(a: list[float], b: list[float], kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        bootstrap_ratio_ci(a, b, **kwargs)  # type: ignore[arg-type]
