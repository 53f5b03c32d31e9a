"""`infertap probe` against a real streaming server on 127.0.0.1 whose TTFT and TPOT we set."""

from __future__ import annotations

import asyncio
import io
import json
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proxy.core.asgi import Receive, Scope, Send
from proxy.sim import create_sim_app
from proxy.sim.config import sim_config_from_dict
from proxy.tools.probe import cli as probe
from proxy.tools.probe.client import Progress, Result
from proxy.tools.probe.target import DEFAULT_PROMPT
from tests.conftest import make_settings, run_proxy, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
SEED_SETTINGS = ROOT / "examples" / "settings.json"
SECRET = "sk-test-do-not-print-4f1c"


@dataclass
class TimedEngine:
    """A controllable OpenAI-compatible chat-completions server (ASGI).

    Each request sends the role-only chunk at once, its first content token after `ttft_s`
    and every next one `tpot_s` later, on an absolute schedule (so send overheads do not add
    up). `jitter` scales each request's TTFT and TPOT by uniform(1 - jitter, 1 + jitter).
    """

    ttft_s: float = 0.05
    tpot_s: float = 0.01
    tokens: int = 10
    jitter: float = 0.0
    seed: int = 0
    usage: bool = True  # honour stream_options.include_usage
    status: int = 200  # answer every chat request with this status
    fail_first: int = 0  # answer the first K chat requests with 503
    reject_stream_options: bool = False  # 400 on stream_options, like some older servers
    no_stream: bool = False  # answer a plain JSON completion even when asked to stream
    model: str = "test-model"
    tpot_for_model: dict[str, float] = field(default_factory=dict)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                done = msg["type"] == "lifespan.shutdown"
                await send({"type": msg["type"] + ".complete"})
                if done:
                    return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path, method = scope["path"], scope["method"]
        if path == "/v1/models" and method == "GET":
            await _json(send, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        elif path == "/v1/chat/completions" and method == "POST":
            try:
                await self._chat(scope, json.loads(raw), send)
            except OSError:  # the client left (a timeout test): nothing more to do
                pass
        else:
            await _json(send, 404, {"error": {"message": f"no route {path}", "type": "not_found"}})

    async def _chat(self, scope: Scope, body: dict[str, Any], send: Send) -> None:
        self.bodies.append(body)
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        n = len(self.bodies)
        if self.status != 200 or n <= self.fail_first:
            status = self.status if self.status != 200 else 503
            await _json(send, status, {"error": {"message": f"test error {status}", "type": "test"}})
            return
        if self.reject_stream_options and "stream_options" in body:
            error = {"message": "unrecognized field: stream_options", "type": "invalid_request_error"}
            await _json(send, 400, {"error": error})
            return
        if self.no_stream:
            await _json(send, 200, {"object": "chat.completion", "choices": []})
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        ttft = self.ttft_s * self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        tpot = self.tpot_for_model.get(body.get("model", ""), self.tpot_s)
        tpot *= self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )

        async def event(obj: Any) -> None:
            data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion.chunk",
                "model": body.get("model"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }

        await event(chunk({"role": "assistant", "content": ""}))  # role-only: not a token
        for i in range(self.tokens):
            await asyncio.sleep(max(0.0, start + ttft + i * tpot - loop.time()))
            await event(chunk({"content": f"tok{i} "}))
        await event(chunk({}, finish="length"))
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": self.tokens, "total_tokens": 7 + self.tokens}
            await event(
                {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "choices": [], "usage": usage}
            )
        await event(b"[DONE]")
        await send({"type": "http.response.body", "body": b""})


async def _json(send: Send, status: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": data})


@contextmanager
def engine(**kwargs: Any) -> Iterator[tuple[TimedEngine, str]]:
    """A TimedEngine served on 127.0.0.1; yields it and its base URL (ending in /v1)."""
    app = TimedEngine(**kwargs)
    with serve_in_thread(app) as url:
        yield app, url + "/v1"


def run_probe(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = probe.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def within(measured: float, expected: float, tolerance: float = 0.20) -> bool:
    return abs(measured - expected) <= tolerance * expected


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- acceptance: the numbers are right ---------------------------------------------------------


def test_reports_the_servers_ttft_and_tpot_within_20_percent(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.200, tpot_s=0.020, tokens=20) as (_, url):
        code, out, _ = run_probe(capsys, "--base-url", url, "--model", "test-model", "-n", "5", "--json")
    assert code == 0
    report = json.loads(out)
    s = report["summary"]
    assert within(s["ttft_s"]["p50"], 0.200), s["ttft_s"]
    assert within(s["tpot_s"]["p50"], 0.020), s["tpot_s"]
    assert within(s["tps"]["p50"], 50.0), s["tps"]
    for r in report["results"]:
        assert r["ok"] and r["output_tokens"] == 20 and r["token_source"] == "usage"
        assert r["tpot_s"] == pytest.approx((r["total_s"] - r["ttft_s"]) / 19)
        assert r["tps"] == pytest.approx(1 / r["tpot_s"])
        assert r["prompt_tokens"] == 7 and r["finish_reason"] == "length" and r["attempts"] == 1


@pytest.mark.parametrize(
    ("sim", "ttft", "tpot"),
    [
        # Fixed timings ([sim] fixed_ttft_ms / fixed_tpot_ms).
        ({"fixed_ttft_ms": 200.0, "fixed_tpot_ms": 20.0}, 0.200, 0.020),
        # The timing model itself: one prefill step of 150 ms, then decode steps of 30 ms.
        (
            {"prefill_base_ms": 150.0, "prefill_ms_per_token": 0.0, "decode_step_ms": 30.0,
             "decode_ms_per_running_seq": 0.0},
            0.150,
            0.030,
        ),
    ],
    ids=["fixed", "modelled"],
)  # fmt: skip
def test_through_infertap_in_front_of_the_sim_within_20_percent(
    capsys: pytest.CaptureFixture[str], sim: dict[str, float], ttft: float, tpot: float
) -> None:
    config = sim_config_from_dict({"sim": {**sim, "default_output_tokens": 20}})
    with serve_in_thread(create_sim_app(config)) as up, run_proxy(make_settings(("sim", up + "/v1"))) as url:
        code, out, err = run_probe(capsys, "--base-url", url + "/v1", "-n", "5", "-c", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    s = report["summary"]
    assert report["target"]["model"] == "sim-model"  # found through infertap's GET /v1/models
    assert within(s["ttft_s"]["p50"], ttft), s["ttft_s"]
    assert within(s["tpot_s"]["p50"], tpot), s["tpot_s"]
    assert all(
        r["ok"] and r["output_tokens"] == 20 and r["token_source"] == "usage" for r in report["results"]
    )


def test_the_responses_api_through_infertap_in_front_of_the_sim(capsys: pytest.CaptureFixture[str]) -> None:
    config = sim_config_from_dict({"sim": {"fixed_ttft_ms": 200.0, "fixed_tpot_ms": 20.0}})
    with serve_in_thread(create_sim_app(config)) as up, run_proxy(make_settings(("sim", up + "/v1"))) as url:
        argv = ["--base-url", url + "/v1", "--api", "responses", "--max-tokens", "12", "-n", "3", "--json"]
        code, out, err = run_probe(capsys, *argv)
    assert code == 0, err
    report = json.loads(out)
    s = report["summary"]
    assert report["target"]["api"] == "responses"
    assert within(s["ttft_s"]["p50"], 0.200), s["ttft_s"]
    assert within(s["tpot_s"]["p50"], 0.020), s["tpot_s"]
    for r in report["results"]:
        # max_output_tokens=12 cut each answer: the usage and the reason come from response.incomplete.
        assert r["ok"] and r["output_tokens"] == 12 and r["token_source"] == "usage"
        assert r["prompt_tokens"] is not None and r["finish_reason"] == "max_output_tokens"


def test_one_request_prints_like_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.200, tpot_s=0.020, tokens=20) as (app, url):
        code, out, _ = run_probe(capsys, "--base-url", url, "--model", "test-model")
    assert code == 0
    lines = dict(line.split(":", 1) for line in out.strip().splitlines())
    assert within(float(lines["TTFT (time to first token)"].split()[0]), 0.200)
    assert within(float(lines["TPOT (time per output token)"].split()[0]), 0.020)
    assert lines["output tokens"].split()[0] == "20" and "usage" in lines["output tokens"]
    assert float(lines["total time"].split()[0]) > 0.2 + 18 * 0.02
    assert within(float(lines["TPS (tokens per second)"]), 50.0)
    body = app.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": DEFAULT_PROMPT}]


def test_n_requests_at_concurrency_report_percentiles(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.200, tpot_s=0.020, tokens=20) as (app, url):
        code, out, err = run_probe(
            capsys,
            "--base-url",
            url,
            "--model",
            "test-model",
            "-n",
            "6",
            "-c",
            "3",
            "--json",
            "--prompt",
            "first",
            "--prompt",
            "second",
        )
    assert code == 0, err
    report = json.loads(out)
    assert report["requests"] == 6 and report["ok"] == 6 and report["failed"] == 0
    assert report["concurrency"] == 3 and report["token_source"] == "usage"
    assert report["errors"] == {}
    s = report["summary"]
    assert set(s) == {"ttft_s", "tpot_s", "total_s", "tps", "output_tokens"}
    assert set(s["ttft_s"]) == {"n", "p50", "p90", "p99", "mean", "min", "max"}
    assert within(s["ttft_s"]["p50"], 0.200) and within(s["tpot_s"]["p50"], 0.020)
    assert s["output_tokens"]["min"] == s["output_tokens"]["max"] == 20
    # 6 requests of ~0.6 s, 3 at a time: two waves, not six.
    assert report["wall_s"] < 6 * 0.58
    assert sorted(r["index"] for r in report["results"]) == list(range(6))
    assert [b["messages"][0]["content"] for b in app.bodies].count("first") == 3
    assert report["target"] == {
        "base_url": url,
        "model": "test-model",
        "api_key_env": "TAOTOKEN_API_KEY",
        "api_key_set": False,
        "api": "chat",
    }


def test_human_summary_for_many_requests(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.05, tpot_s=0.01, tokens=5) as (_, url):
        code, out, _ = run_probe(capsys, "--base-url", url, "--model", "m", "-n", "3", "-c", "3")
    assert code == 0
    assert "3 ok, 0 failed" in out
    header = next(line for line in out.splitlines() if "p50" in line)
    assert header.split() == ["p50", "p90", "p99", "mean"]
    assert any(line.startswith("TTFT") for line in out.splitlines())
    assert any(line.startswith("TPOT") for line in out.splitlines())


def test_without_usage_tokens_are_counted_and_the_report_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.05, tpot_s=0.01, tokens=8, usage=False) as (_, url):
        code, out, _ = run_probe(capsys, "--base-url", url, "--model", "m")
        assert code == 0
        assert "8 (counted content events: the server sent no usage" in out
        code, out, _ = run_probe(capsys, "--base-url", url, "--model", "m", "--json")
    r = json.loads(out)["results"][0]
    assert r["output_tokens"] == 8 and r["token_source"] == "counted"


def test_no_usage_flag_does_not_ask_for_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(tokens=3) as (app, url):
        code, out, _ = run_probe(capsys, "--base-url", url, "--model", "m", "--no-usage", "--json")
    assert code == 0 and "stream_options" not in app.bodies[0]
    assert json.loads(out)["token_source"] == "counted"


def test_a_server_refusing_stream_options_is_asked_without_it(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(tokens=5, reject_stream_options=True) as (app, url):
        code, out, err = run_probe(
            capsys, "--base-url", url, "--model", "m", "-n", "3", "--retries", "0", "--json"
        )
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] == 3 and report["token_source"] == "counted"
    assert [("stream_options" in b) for b in app.bodies] == [True, False, False, False]  # learnt once


def test_a_server_that_does_not_stream(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(no_stream=True) as (_, url):
        code, _, err = run_probe(capsys, "--base-url", url, "--model", "m")
    assert code == 1 and "not an event stream" in err


def test_model_comes_from_the_models_list_when_not_given(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(tokens=3, model="listed-model") as (app, url):
        code, out, _ = run_probe(capsys, "--base-url", url, "--json")
    assert code == 0
    assert app.bodies[0]["model"] == "listed-model"
    assert json.loads(out)["target"]["model"] == "listed-model"


# -- the seed's settings.json, as is -----------------------------------------------------------


def test_seed_settings_json_is_honoured(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TAOTOKEN_API_KEY", SECRET)
    with engine(tokens=4) as (app, url):
        code, out, err = run_probe(capsys, "--settings", str(SEED_SETTINGS), "--base-url", url, "--json")
    assert code == 0, err
    body = app.bodies[0]
    assert body["model"] == "your-model-name"
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (0.7, 0.9, 50, 512)
    assert body["stream"] is True
    assert app.headers[0]["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in out + err
    report = json.loads(out)
    assert report["target"]["api_key_env"] == "TAOTOKEN_API_KEY" and report["target"]["api_key_set"] is True


def test_flags_override_settings_and_settings_override_env(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = json.loads(SEED_SETTINGS.read_text())
    with engine(tokens=3) as (app, url):
        settings["base_url"] = url
        path = tmp_path / "settings.json"
        path.write_text(json.dumps(settings))
        monkeypatch.setenv("TAOTOKEN_BASE_URL", "http://127.0.0.1:9/v1")  # settings win over the env
        code, _, err = run_probe(
            capsys, "--settings", str(path), "--model", "flag-model", "--max-tokens", "7"
        )
    assert code == 0, err
    assert app.bodies[0]["model"] == "flag-model" and app.bodies[0]["max_tokens"] == 7


def test_env_base_url_is_the_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine(tokens=3) as (app, url):
        monkeypatch.setenv("TAOTOKEN_BASE_URL", url)
        code, _, _ = run_probe(capsys, "--model", "m")
    assert code == 0 and len(app.bodies) == 1


def test_retries_with_backoff_from_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(tokens=3, fail_first=2) as (app, url):
        code, out, _ = run_probe(
            capsys, "--base-url", url, "--model", "m", "--retries", "2", "--backoff", "0", "--json"
        )
    assert code == 0
    assert json.loads(out)["results"][0]["attempts"] == 3 and len(app.bodies) == 3


# -- errors: a clear line and a non-zero exit, never a traceback or the key --------------------


def test_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    code, out, err = run_probe(capsys, "--base-url", url, "--model", "m", "--retries", "0")
    assert code == 1 and out == ""
    assert "cannot connect to 127.0.0.1" in err and "connection refused" in err


def test_unauthorized_names_the_key_variable_not_the_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_KEY", SECRET)
    with engine(status=401) as (_, url):
        code, out, err = run_probe(capsys, "--base-url", url, "--model", "m", "--api-key-env", "MY_KEY")
        assert code == 1
        assert "HTTP 401" in err and "$MY_KEY" in err and "refused" in err
        assert SECRET not in out + err
        code, out, err = run_probe(capsys, "--base-url", url, "--model", "m", "--json")
    assert code == 1
    r = json.loads(out)["results"][0]
    assert r["error_kind"] == "auth_error" and r["status"] == 401 and r["attempts"] == 1  # 401 is not retried
    assert "$TAOTOKEN_API_KEY, which is not set" in r["error"]


def test_ttft_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.6) as (_, url):
        code, out, err = run_probe(
            capsys, "--base-url", url, "--model", "m", "--timeout-read", "0.15", "--json"
        )
    assert code == 1
    r = json.loads(out)["results"][0]
    assert r["error_kind"] == "ttft_timeout" and "no output text" in r["error"] and "0.15 s" in r["error"]


def test_wrong_base_url_hints_at_v1(capsys: pytest.CaptureFixture[str]) -> None:
    with engine() as (_, url):
        code, _, err = run_probe(capsys, "--base-url", url.removesuffix("/v1"), "--model", "m")
    assert code == 1 and "HTTP 404" in err and "/v1" in err


def test_some_failures_in_a_run(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(tokens=3, fail_first=2) as (_, url):
        code, out, err = run_probe(capsys, "--base-url", url, "--model", "m", "-n", "4", "--retries", "0")
    assert code == 1
    assert "2 ok, 2 failed" in out and "upstream_error x2" in out
    assert "2 of 4 requests failed" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "0"], "-n must be at least 1"),
        (["--base-url", "ftp://x"], "http:// or https://"),
        (["--settings", "/nonexistent/settings.json"], "settings file not found"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    ],
)
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run_probe(capsys, *argv)
    assert code == 2 and message in err


def test_bad_settings_field_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"retry": {"max_attempts": 0}}))
    code, _, err = run_probe(capsys, "--settings", str(path))
    assert code == 2 and "retry.max_attempts" in err


def test_usage_error_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_probe(capsys, "--no-such-flag")
    assert code == 2 and "unrecognized arguments" in err


def test_help_from_the_command_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "probe", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--base-url" in proc.stdout and "--settings" in proc.stdout and "examples:" in proc.stdout


# -- pieces ------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal() -> None:
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = Progress(3, stream)
        for i in range(3):
            p(Result(index=i, ok=i != 1))
        p.close()
    assert "\r3/3 done, 1 failed" in tty.getvalue() and tty.getvalue().endswith("\n")
    assert pipe.getvalue() == ""


def test_tpot_follows_the_seed_formula() -> None:
    r = Result(index=0, ok=True, ttft_s=0.5, total_s=2.5, output_tokens=101)
    assert r.tpot_s == pytest.approx(0.02) and r.tps == pytest.approx(50.0)
    single = Result(index=0, ok=True, ttft_s=0.5, total_s=0.6, output_tokens=1)
    assert single.tpot_s == pytest.approx(0.1)  # max(tokens - 1, 1)
