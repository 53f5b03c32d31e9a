"""`infertap sim` timing changes at run time: POST /admin/timing and SIGHUP, without a restart."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from proxy.sim import SimConfig, create_sim_app
from tests.conftest import serve_in_thread, wait_until

ROOT = Path(__file__).resolve().parent.parent


def sim_ttft(base: str, prompt_words: int) -> tuple[float, float]:
    """Send one request; return the sim's own TTFT histogram (sum in s, count) after it, so the
    assertion needs no clock in the test."""
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "word " * prompt_words}],
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        r.read()
    text = httpx.get(f"{base}/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total = float(line.split()[-1])
        if line.startswith("vllm:time_to_first_token_seconds_count"):
            count = float(line.split()[-1])
    return total, count


def test_post_timing_changes_the_running_engine_and_refuses_what_cannot_change() -> None:
    config = SimConfig.model_validate({"sim": {"fixed_tpot_ms": 1, "prefill_base_ms": 5}})
    with serve_in_thread(create_sim_app(config)) as base:
        now = httpx.get(f"{base}/admin/timing", timeout=5).json()
        assert now["sim"]["prefill_base_ms"] == 5 and now["batching"]["max_num_seqs"] == 64
        r = httpx.post(
            f"{base}/admin/timing",
            json={"sim": {"prefill_base_ms": 300}, "batching": {"max_num_seqs": 4}},
            timeout=5,
        )
        assert r.status_code == 200, r.text
        assert r.json()["sim"]["prefill_base_ms"] == 300 and r.json()["batching"]["max_num_seqs"] == 4
        # The next request already gets the new prefill cost (the sim's own TTFT histogram).
        total, count = sim_ttft(base, 10)
        assert count == 1 and total >= 0.3
        for bad, where in (
            ({"kv_cache": {"enable": False}}, "kv_cache: not a timing section"),
            ({"sim": {"seed": 3}}, "sim.seed: cannot change at run time"),
            ({"sim": {"prefill_base_ms": -1}}, "sim: prefill_base_ms"),
            ([1], "must be a JSON object"),
        ):
            r = httpx.post(f"{base}/admin/timing", json=bad, timeout=5)
            assert r.status_code == 400 and where in r.json()["error"]["message"], (bad, r.text)
        # All or nothing: a bad key next to a good one changes nothing.
        r = httpx.post(
            f"{base}/admin/timing", json={"sim": {"prefill_base_ms": 1}, "model": {"name": "x"}}, timeout=5
        )
        assert r.status_code == 400
        assert httpx.get(f"{base}/admin/timing", timeout=5).json()["sim"]["prefill_base_ms"] == 300
        r = httpx.post(f"{base}/admin/timing", content=b"{", timeout=5)
        assert r.status_code == 400 and "not valid JSON" in r.text


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_sighup_rereads_the_timing_of_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "engine.toml"
    cfg.write_text("[sim]\nprefill_ms_per_token = 0.05\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "sim", "--port", "0", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ},
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the sim did not start"
        base = proc.stdout.readline().split(" on ", 1)[1].strip().removesuffix("/v1")

        def per_token() -> float:
            return float(httpx.get(f"{base}/admin/timing", timeout=5).json()["sim"]["prefill_ms_per_token"])

        assert per_token() == 0.05
        cfg.write_text("[sim]\nprefill_ms_per_token = 0.2\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: per_token() == 0.2, 10, "SIGHUP to reload the timing")
        cfg.write_text("[sim]\nprefill_ms_per_token = -3\n")  # a bad file keeps what runs
        proc.send_signal(signal.SIGHUP)
        cfg.write_text("[sim]\nprefill_ms_per_token = 0.3\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: per_token() == 0.3, 10, "the next good reload")
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
