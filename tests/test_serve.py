"""`infertap serve` as a user runs it: a real process, the embedded engine, real clients."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from proxy.server.exposure import is_loopback
from tests.conftest import CHAT, serve_process, wait_until

MESSAGES = [{"role": "user", "content": "Explain prefill and decode."}]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """infertap with no upstream configured: it must start its simulated engine by itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_"))}
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process(env=env, log=log) as (base, _):
        wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 200, 30, "the embedded engine")
        yield base
    assert "embedded simulated engine" in log.read_text()  # it says clearly where requests go


def test_openai_sdk_sync_and_async_through_the_embedded_default(embedded: str) -> None:
    client = openai.OpenAI(base_url=f"{embedded}/v1", api_key="unused", max_retries=0)
    full = client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    assert full.choices[0].message.content and full.usage and full.usage.completion_tokens == 8
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=8, stream=True
        )
        if c.choices
    ]  # type: ignore[arg-type]
    assert "".join(parts).strip()
    client.close()

    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=f"{embedded}/v1", api_key="unused", max_retries=0)
        done = await aclient.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=6)  # type: ignore[arg-type]
        streamed = []
        async for c in await aclient.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,
            max_tokens=6,
            stream=True,  # type: ignore[arg-type]
        ):
            if c.choices:
                streamed.append(c.choices[0].delta.content or "")
        await aclient.close()
        return done.choices[0].message.content or "", "".join(streamed)

    full_text, streamed_text = asyncio.run(run())
    assert full_text.strip() and streamed_text.strip()
    metrics = httpx.get(f"{embedded}/metrics").text
    assert (
        'infertap_requests_total{client="anonymous",model="sim-model",outcome="ok",route="chat.completions",'
        'stream="true",'
        'upstream="sim"}' in metrics
    )


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_streams_through_the_embedded_default(embedded: str) -> None:
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"{embedded}/v1/chat/completions",
            "-H",
            "content-type: application/json",
            "-d",
            '{"model": "sim-model", "stream": true, "max_tokens": 4, '
            '"messages": [{"role": "user", "content": "Hello"}]}',
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    events = [e for e in out.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    assert sum('"content":"' in e and '"content":""' not in e for e in events) == 4
    assert '"choices":[]' not in out  # the usage chunk infertap asked for is not shown to curl


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "serve", *args], capture_output=True, text=True, timeout=60, env=env
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited already


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from /proc")
@pytest.mark.parametrize(
    ("sig", "exit_code"),
    [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)],
    ids=["SIGTERM", "SIGINT", "SIGKILL"],
)
def test_the_embedded_engine_never_outlives_the_proxy(sig: signal.Signals, exit_code: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_"))}
    # Ctrl-C at a terminal finds SIGINT at its default. A shell's background job (`.ci/run &` in a
    # script) inherits it ignored, and so would the server started here: uvicorn then shuts down
    # on it as on any SIGINT but cannot end by it (exit 0), as a program that was told to ignore it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not inherited: the default
    try:
        _end_by(sig, exit_code, env)
    finally:
        signal.signal(signal.SIGINT, previous)


def _end_by(sig: signal.Signals, exit_code: int, env: dict[str, str]) -> None:
    with serve_process(env=env) as (base, proc):
        wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 200, 30, "the embedded engine")
        (sim,) = _children(proc.pid)
        proc.send_signal(sig)
        code = proc.wait(timeout=20)
        # However the proxy ends (a service manager's SIGTERM, Ctrl-C, even SIGKILL), its engine goes too.
        wait_until(lambda: not _alive(sim), 15, "the embedded engine to exit")
    assert code == exit_code


def test_a_wrong_config_names_the_field_without_a_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[server]\nport = "eighty"\n[[upstreams]]\nname = "x"\nbase_url = "ftp://nope"\n')
    r = _serve("--config", str(cfg))
    assert r.returncode == 2
    assert "server.port" in r.stderr and "upstreams.0.base_url" in r.stderr
    assert "Traceback" not in r.stderr
    r = _serve("--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    cfg.write_text("[server\n")
    r = _serve("--config", str(cfg))
    assert r.returncode == 2 and "not valid TOML" in r.stderr


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("timeouts = {ttft = 0}", "upstreams.0.timeouts.ttft"),
        ("retry = {backoff_seconds = -1}", "upstreams.0.retry"),
    ],
)
def test_an_upstreams_own_timeouts_are_checked_with_the_rest(
    tmp_path: Path, override: str, named: str
) -> None:
    """Regression: they were checked only when the server built its routing (two tracebacks, exit 3)."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[[upstreams]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\n{override}\n')
    r = _serve("--config", str(cfg), "--port", "0", env=_clean_env())
    _one_clear_line(r, named)


def test_help_lists_commands_and_options() -> None:
    top = subprocess.run(
        [sys.executable, "-m", "proxy", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in top.stdout and "sim" in top.stdout
    serve = _serve("--help")
    assert serve.returncode == 0 and "--upstream" in serve.stdout and "TAOTOKEN_API_KEY" in serve.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_"))}
    return {**env, **extra}


def _one_clear_line(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert all(n in r.stderr for n in needles), r.stderr


@pytest.mark.parametrize(
    ("var", "value"),
    [("INFERTAP_UPSTREAMS", '[{"name": '), ("INFERTAP_SERVER", '{"port": ')],
)
def test_a_malformed_environment_variable_is_one_clear_line(var: str, value: str) -> None:
    r = _serve(env=_clean_env(**{var: value}))
    _one_clear_line(r, var, "not valid JSON")
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_misspelled_section_in_the_environment_is_reported_like_one_in_the_file() -> None:
    r = _serve(env=_clean_env(INFERTAP_SEVER__PORT="9000"))
    _one_clear_line(r, "INFERTAP_SEVER__PORT: unknown field", "INFERTAP_SERVER__PORT")


def test_flags_are_validated_and_errors_name_the_flag() -> None:
    closed = "http://127.0.0.1:9/v1"
    _one_clear_line(_serve("--port", "99999", "--upstream", closed, env=_clean_env()), "--port 99999")
    _one_clear_line(_serve("--workers", "0", "--upstream", closed, env=_clean_env()), "--workers 0")
    r = _serve("--upstream", f"a={closed}", "--upstream", "a=http://127.0.0.1:10/v1", env=_clean_env())
    _one_clear_line(r, "upstream names must be unique", "a")


def test_two_bare_upstream_urls_on_one_host_get_distinct_names() -> None:
    from proxy.server.options import build_parser, resolve_settings

    args = build_parser().parse_args(
        ["--upstream", "http://127.0.0.1:8000/v1", "--upstream", "http://127.0.0.1:8001/v1"]
    )
    settings = resolve_settings(args)
    assert [u.name for u in settings.upstreams] == ["127.0.0.1", "127.0.0.1:8001"]


def test_sim_port_out_of_range_or_taken_is_one_clear_line() -> None:
    def sim(port: int) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "proxy", "sim", "--port", str(port)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    r = sim(99999)
    _one_clear_line(r, "--port", "99999")
    assert len(r.stderr.strip().splitlines()) == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = sim(taken.getsockname()[1])
    _one_clear_line(r, "in use", "--port")
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_base_url_without_v1_gets_a_start_up_warning(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve_process("--upstream", "vllm=http://127.0.0.1:9", env=_clean_env(), log=log):
        pass
    text = log.read_text()
    assert "WARNING" in text and "write http://127.0.0.1:9/v1" in text
    assert "--upstream vllm=http://127.0.0.1:9/v1" in text

    from proxy.core.model_routing import ModelRouter
    from proxy.settings import Settings, UpstreamSettings

    routing = ModelRouter.from_settings(
        Settings(
            upstreams=[
                UpstreamSettings(name="bare", base_url="http://127.0.0.1:8000/"),
                UpstreamSettings(name="ok", base_url="http://127.0.0.1:8000/v1"),
                UpstreamSettings(name="taotoken", base_url="https://taotoken.net/api"),
            ]
        )
    )
    warned = {u.name: u.config_warnings for u in routing.upstreams}
    assert len(warned["bare"]) == 1 and warned["ok"] == () and warned["taotoken"] == ()


def test_a_taken_port_fails_before_start_up_with_a_message(tmp_path: Path) -> None:
    """Regression (issue 16): "Application startup complete." came before the bind error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_"))}
    env["INFERTAP_UPSTREAMS"] = '[{"name": "x", "base_url": "http://127.0.0.1:9/v1"}]'
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve("--host", "127.0.0.1", "--port", str(port), env=env)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "Application startup complete" not in r.stderr and "Traceback" not in r.stderr


def test_a_directory_given_as_config_says_so(tmp_path: Path) -> None:
    r = _serve("--config", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr and "not found" not in r.stderr


def test_workers_log_their_lines_and_the_access_log(tmp_path: Path) -> None:
    """Regression: with --workers N the workers' infertap.* lines (the access log, the upstream
    list) went nowhere; only uvicorn's own lines reached stderr."""
    log = tmp_path / "serve.log"
    with serve_process("--workers", "2", env=_clean_env(), log=log) as (base, _):
        rids = []
        for _ in range(4):
            r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 200
            rids.append(r.headers["x-request-id"])

        def logged() -> bool:
            text = log.read_text()
            return all(rid in text for rid in rids)

        wait_until(logged, 30, "every request's access log line")
    text = log.read_text()
    assert "infertap.access" in text
    assert text.count("infertap.app: upstream sim [default]") == 2, text  # one per worker


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5"])
def test_listening_beyond_loopback_without_client_keys_is_refused(host: str) -> None:
    """Issue 24: anyone who reaches a non-loopback address would use the upstreams' keys; start-up
    says what to do instead (before: it started, open to everyone)."""
    env = _clean_env(INFERTAP_UPSTREAMS='[{"name": "x", "base_url": "http://127.0.0.1:9/v1"}]')
    r = _serve("--host", host, "--port", "0", env=env)
    _one_clear_line(r, f"refusing to listen on {host} without client keys", "keys_env", "open = true")
    assert "--host 127.0.0.1" in r.stderr and "Application startup complete" not in r.stderr


@pytest.mark.parametrize(
    "extra",
    [
        {"INFERTAP_AUTH__KEYS_ENV": "TEST_CLIENT_KEYS", "TEST_CLIENT_KEYS": "k-1"},
        {"INFERTAP_AUTH__OPEN": "true"},
    ],
    ids=["client-keys", "open"],
)
def test_listening_beyond_loopback_with_client_keys_or_said_open_starts(extra: dict[str, str]) -> None:
    env = _clean_env(INFERTAP_UPSTREAMS='[{"name": "x", "base_url": "http://127.0.0.1:9/v1"}]', **extra)
    with serve_process("--host", "0.0.0.0", env=env) as (base, _):  # reached through 127.0.0.1 only
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.7", False),
        ("fe80::1", False),
        ("example.internal", False),
    ],
)
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
