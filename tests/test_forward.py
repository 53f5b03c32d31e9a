"""The streaming core, end to end: real clients -> infertap -> a real upstream, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest

from proxy.core.exchange import Exchange
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, wait_until


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def test_stream_bytes_reach_the_client_unchanged(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    rec = RecordingObserver()
    with run_proxy(make_settings(("fake", url)), rec) as proxy:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        with (
            httpx.Client() as c,
            c.stream(
                "POST",
                f"{proxy}/v1/chat/completions",
                json=body,
                headers={"x-request-id": "bytes-1", "x-fake-events": "12"},
            ) as r,
        ):
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-cache"
            # Once, though the upstream sends its own too.
            assert r.headers.get_list("x-accel-buffering") == ["no"]
            assert r.headers["x-request-id"] == "bytes-1"
            received = b"".join(r.iter_raw())
        ex = rec.wait_terminal("bytes-1")
    assert received == upstream.sent["bytes-1"]
    assert received.endswith(b"data: [DONE]\n\n")
    assert ex.output_events == 12 and ex.completion_tokens == 12 and ex.prompt_tokens == 7
    assert upstream.requests[-1].headers["x-request-id"] == "bytes-1"


def test_events_are_not_bunched(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        arrivals: list[float] = []
        with (
            httpx.Client() as c,
            c.stream(
                "POST",
                f"{proxy}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers={"x-fake-events": "4", "x-fake-gap-ms": "200"},
            ) as r,
        ):
            for line in r.iter_lines():
                if '"content":"tok' in line:
                    arrivals.append(time.perf_counter())
    assert len(arrivals) == 4
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # The upstream writes 200 ms apart: each must arrive separately, not all at the end.
    assert all(g > 0.1 for g in gaps), gaps


def test_openai_sdk_sync_and_async_stream_and_not(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="sk-client", max_retries=0)
        done = client.chat.completions.create(model="fake-model", messages=CHAT["messages"])
        assert done.choices[0].message.content == "tok " * 5
        assert done.usage is not None and done.usage.completion_tokens == 5
        stream = client.chat.completions.create(model="fake-model", messages=CHAT["messages"], stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        assert text == "".join(f"tok{i} " for i in range(5))
        client.close()

        async def run_async() -> tuple[str, str]:
            aclient = openai.AsyncOpenAI(base_url=f"{proxy}/v1", api_key="sk-client", max_retries=0)
            full = await aclient.chat.completions.create(model="fake-model", messages=CHAT["messages"])
            parts = []
            async for chunk in await aclient.chat.completions.create(
                model="fake-model", messages=CHAT["messages"], stream=True
            ):
                parts.append(chunk.choices[0].delta.content or "")
            await aclient.close()
            return full.choices[0].message.content or "", "".join(parts)

        full, streamed = asyncio.run(run_async())
        assert full == "tok " * 5 and streamed == "".join(f"tok{i} " for i in range(5))


def test_usage_chunk_stripped_only_when_infertap_asked(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    rec = RecordingObserver()
    with run_proxy(make_settings(("fake", url)), rec) as proxy, httpx.Client() as c:
        raw = c.post(
            f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "nousage"}
        ).content
        assert upstream.requests[-1].json()["stream_options"] == {"include_usage": True}
        assert b'"choices":[]' not in raw
        assert rec.wait_terminal("nousage").completion_tokens == 5
        raw = c.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            headers={"x-request-id": "usage"},
        ).content
        assert raw.count(b'"choices":[]') == 1
        assert rec.wait_terminal("usage").completion_tokens == 5


@pytest.mark.parametrize(
    ("headers", "expected_terminal"),
    [
        ({}, "finished"),
        ({"x-fake-status": "500"}, "failed"),
        ({"x-fake-status": "400"}, "failed"),
        ({"x-fake-no-done": "1"}, "failed"),
        ({"x-fake-cut": "2"}, "failed"),
    ],
)
def test_exactly_one_terminal_hook(
    fake: tuple[FakeUpstream, str], headers: dict[str, str], expected_terminal: str
) -> None:
    _, url = fake
    rec = RecordingObserver()
    settings = make_settings(("fake", url))
    settings.retry.max_attempts = 1
    with run_proxy(settings, rec) as proxy, httpx.Client() as c:
        c.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-request-id": "t1", **headers},
        )
        rec.wait_terminal("t1")
        hooks = rec.hooks_for("t1")
    assert hooks[0] == "request_received"
    assert hooks[-2:] == [expected_terminal, "ended"]
    assert rec.terminal_count("t1") == 1 and hooks.count("ended") == 1


def test_upstream_cut_mid_stream_makes_the_sdk_raise(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    rec = RecordingObserver()
    with run_proxy(make_settings(("fake", url)), rec) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(
                model="fake-model",
                messages=CHAT["messages"],
                stream=True,
                extra_headers={"x-fake-cut": "2", "x-request-id": "cut"},
            ):
                pass
        client.close()
        assert rec.wait_terminal("cut").outcome == "stream_interrupted"


@pytest.mark.parametrize("where", ["before-headers", "after-role", "after-first"])
def test_client_disconnect_cancels_upstream(fake: tuple[FakeUpstream, str], where: str) -> None:
    upstream, url = fake
    rec = RecordingObserver()
    with run_proxy(make_settings(("fake", url)), rec) as proxy:
        with httpx.Client(timeout=httpx.Timeout(10, read=0.5)) as c:
            with pytest.raises(httpx.ReadTimeout):
                with c.stream(
                    "POST",
                    f"{proxy}/v1/chat/completions",
                    json={**CHAT, "stream": True},
                    headers={"x-request-id": "gone", "x-fake-hang": where},
                ) as r:
                    for _ in r.iter_raw():
                        pass
        # Leaving the client closed the connection: infertap must cancel the upstream request.
        assert upstream.disconnected.wait(10), "the upstream never saw its connection closed"
        ex = rec.wait_terminal("gone")
        assert ex.outcome == "client_disconnect"
        assert rec.hooks_for("gone")[-2:] == ["client_disconnected", "ended"]
        assert rec.terminal_count("gone") == 1
        assert (ex.first_token_at is None) == (where != "after-first")


@pytest.mark.parametrize(
    ("path", "method", "body", "status", "code"),
    [
        ("/v1/chat/completions", "POST", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", "POST", b"[1, 2]", 400, "invalid_json"),
        ("/v1/chat/completions", "POST", b"", 400, "invalid_json"),
        ("/v1/chat/completions", "POST", b'{"messages": []}', 400, "missing_model"),
        ("/v1/completions", "POST", b'{"model": 3}', 400, "missing_model"),
        ("/v1/chat/completions", "POST", b'{"model": "m", "stream": "yes"}', 400, "invalid_stream"),
        (
            "/v1/chat/completions",
            "POST",
            b'{"model": "m", "pad": "' + b"x" * 5000 + b'"}',
            413,
            "request_too_large",
        ),
        ("/v1/chat/completions", "GET", b"", 405, "method_not_allowed"),
        ("/nope", "GET", b"", 404, "not_found"),
    ],
)
def test_bad_input_gets_an_openai_error(
    fake: tuple[FakeUpstream, str], path: str, method: str, body: bytes, status: int, code: str
) -> None:
    upstream, url = fake
    settings = make_settings(("fake", url))
    settings.server.max_body_bytes = 4096
    with run_proxy(settings) as proxy, httpx.Client() as c:
        r = c.request(method, proxy + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    assert not upstream.requests, "bad input must not reach the upstream"


def test_unreachable_upstream_is_a_502_naming_it() -> None:
    settings = make_settings(("deadhost", "http://127.0.0.1:9/v1"))
    settings.retry.max_attempts = 1
    with run_proxy(settings) as proxy, httpx.Client() as c:
        r = c.post(f"{proxy}/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    err = r.json()["error"]
    assert "deadhost" in err["message"] and err["type"] == "connect_error"


def test_upstream_errors_pass_through_unchanged(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = make_settings(("fake", url))
    settings.retry.max_attempts = 1
    with run_proxy(settings) as proxy, httpx.Client() as c:
        r = c.post(f"{proxy}/v1/chat/completions", json=CHAT, headers={"x-fake-status": "422"})
    assert r.status_code == 422
    assert r.json() == {"error": {"message": "fake error 422", "type": "fake", "code": 422}}


def test_upstream_key_reaches_upstream_and_nowhere_else(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    upstream, url = fake
    secret = "sk-upstream-SECRET-5f1c9e"
    monkeypatch.setenv("FAKE_UPSTREAM_KEY", secret)
    settings = make_settings(("fake", url))
    settings.upstreams[0].api_key_env = "FAKE_UPSTREAM_KEY"
    settings.retry.max_attempts = 1
    caplog.set_level(logging.DEBUG)
    seen: list[bytes] = []
    rec = _ReprObserver()
    with run_proxy(settings, rec) as proxy, httpx.Client() as c:
        auth = {"authorization": "Bearer sk-client-own"}
        for extra in ({}, {"x-fake-status": "500"}, {"x-fake-cut": "1"}):
            r = c.post(
                f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True}, headers={**auth, **extra}
            )
            seen.append(r.content + json.dumps(dict(r.headers)).encode())
        r = c.post(f"{proxy}/v1/chat/completions", json=CHAT, headers=auth)
        seen.append(r.content + json.dumps(dict(r.headers)).encode())
        seen.append(c.get(f"{proxy}/v1/models").content)
        seen.append(c.get(f"{proxy}/readyz").content)
    for req in upstream.requests:
        assert req.headers["authorization"] == f"Bearer {secret}"
    assert all(secret.encode() not in s for s in seen)
    assert secret not in caplog.text
    assert "sk-client-own" not in json.dumps([r.headers for r in upstream.requests])
    # Nothing an observer receives holds the key: one careless log call would print it.
    assert len(rec.reprs) > 20 and not any(secret in r for r in rec.reprs)


class _ReprObserver(RecordingObserver):
    """Takes repr() of the Exchange at every hook, as a careless log call would."""

    def __init__(self) -> None:
        super().__init__()
        self.reprs: list[str] = []

    def _rec(self, hook: str, ex: Exchange) -> None:
        super()._rec(hook, ex)
        with self.lock:
            self.reprs.append(repr(ex) + repr(ex.upstream_headers) + repr(ex.scratch))


def test_models_union_marks_upstreams_and_skips_dead_ones(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = make_settings(("fake", url), ("dead", "http://127.0.0.1:9/v1"))
    with run_proxy(settings) as proxy, httpx.Client() as c:
        r = c.get(f"{proxy}/v1/models")
        ready = c.get(f"{proxy}/readyz")
        health = c.get(f"{proxy}/healthz")
        wait_until(lambda: c.get(f"{proxy}/status").json()["upstreams"][1]["last_check"] is not None)
        status = c.get(f"{proxy}/status").json()
    assert r.status_code == 200
    assert [(m["id"], m["upstream"]) for m in r.json()["data"]] == [("fake-model", "fake")]
    assert ready.status_code == 200 and health.status_code == 200
    fake_row, dead_row = status["upstreams"]
    assert fake_row["reachable"] is True and fake_row["circuit"]["state"] == "closed"
    assert dead_row["reachable"] is False and dead_row["check_error"] == "is unreachable: connection refused"


def _model_list_fetches(upstream: FakeUpstream) -> int:
    return sum(1 for r in upstream.requests if r.path.endswith("/models"))


def test_models_list_is_fetched_once_per_configuration(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: every GET /v1/models asked every upstream. Now the union is kept for
    [server] models_cache_seconds, and a reload (a new configuration) asks again."""
    from proxy.app import create_app
    from tests.conftest import serve_in_thread

    upstream, url = fake
    monkeypatch.setenv("RT_ADMIN", "adm")
    settings = make_settings(
        ("fake", url), server={"models_cache_seconds": 600}, auth={"admin_token_env": "RT_ADMIN"}
    )
    with serve_in_thread(create_app(settings, reload=lambda: settings)) as proxy, httpx.Client() as c:
        first = [c.get(f"{proxy}/v1/models") for _ in range(3)]
        assert [r.status_code for r in first] == [200] * 3 and len({r.content for r in first}) == 1
        assert _model_list_fetches(upstream) == 1
        reloaded = c.post(f"{proxy}/admin/reload", headers={"authorization": "Bearer adm"})
        assert reloaded.status_code == 200, reloaded.text
        assert c.get(f"{proxy}/v1/models").content == first[0].content
        assert _model_list_fetches(upstream) == 2
    before = _model_list_fetches(upstream)
    with (
        run_proxy(make_settings(("fake", url), server={"models_cache_seconds": 0})) as proxy,
        httpx.Client() as c,
    ):
        for _ in range(2):
            assert c.get(f"{proxy}/v1/models").status_code == 200
    assert _model_list_fetches(upstream) == before + 2  # 0: every call asks


def test_callers_of_the_models_list_share_one_fetch() -> None:
    """Callers that come while the upstreams are being asked wait for that answer, and one that
    goes away does not cancel it for the others; a list with nothing in it is not kept."""
    from proxy.control.model_list import ModelLists, ModelUnion
    from proxy.core.model_routing import ModelRouter

    routing = ModelRouter.from_settings(make_settings(("a", "http://127.0.0.1:9/v1")))
    fetches: list[asyncio.Event] = []

    async def fetch(_routing: ModelRouter, _client: object) -> ModelUnion:
        gate = asyncio.Event()
        fetches.append(gate)
        await gate.wait()
        return ModelUnion(b"[]", len(fetches) - 1, [])  # the first lists nothing

    async def main() -> None:
        lists = ModelLists(600, fetch)  # type: ignore[arg-type]
        callers = [asyncio.create_task(lists.get(routing, None)) for _ in range(5)]  # type: ignore[arg-type]
        while not fetches:
            await asyncio.sleep(0)
        callers[0].cancel()
        fetches[0].set()
        got = await asyncio.gather(*callers[1:])
        assert len(fetches) == 1 and all(u is got[0] for u in got)
        again = asyncio.create_task(lists.get(routing, None))  # type: ignore[arg-type]
        while len(fetches) < 2:  # nothing listed: not kept, asked again
            await asyncio.sleep(0)
        fetches[1].set()
        kept = await again
        assert kept.listed == 1 and await lists.get(routing, None) is kept  # type: ignore[arg-type]
        assert len(fetches) == 2

    asyncio.run(main())


def test_readyz_answers_from_process_state() -> None:
    """/readyz never waits on an upstream; with ready_needs_upstream it also needs one whose
    circuit is not open."""
    settings = make_settings(("dead", "http://127.0.0.1:9/v1"))
    settings.retry.max_attempts = 1
    settings.circuit.min_calls = 1
    settings.circuit.cooldown_seconds = 600
    with run_proxy(settings) as proxy, httpx.Client() as c:
        assert c.get(f"{proxy}/readyz").status_code == 200  # a dead upstream is not this process's fault
    settings.server.ready_needs_upstream = True
    with run_proxy(settings) as proxy, httpx.Client() as c:
        assert c.get(f"{proxy}/readyz").status_code == 200  # nothing known against it yet
        assert c.post(f"{proxy}/v1/chat/completions", json=CHAT).status_code == 502  # opens its circuit
        r = c.get(f"{proxy}/readyz")
        assert r.status_code == 503 and "circuit" in r.json()["status"]


def test_routing_by_model_glob_and_passthrough(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    second = FakeUpstream()
    from tests.conftest import serve_in_thread

    with serve_in_thread(second) as url2:
        settings = make_settings(("a", url), ("b", url2 + "/v1"))
        settings.upstreams[1].models = ["llama-*"]
        rec = RecordingObserver()
        with run_proxy(settings, rec) as proxy, httpx.Client() as c:
            c.post(
                f"{proxy}/v1/chat/completions",
                json={**CHAT, "model": "llama-3"},
                headers={"x-request-id": "r1"},
            )
            c.post(f"{proxy}/v1/chat/completions", json=CHAT, headers={"x-request-id": "r2"})
            emb = c.post(f"{proxy}/v1/embeddings", json={"model": "llama-e", "input": "hi"})
            other = c.get(f"{proxy}/v1/models/fake-model?x=1")
            wait_until(lambda: rec.terminal_count("r1") + rec.terminal_count("r2") == 2)
        assert rec.exchanges["r1"].upstream == "b" and rec.exchanges["r2"].upstream == "a"
        assert emb.status_code == 200 and second.requests[-1].path == "/v1/embeddings"
        assert other.status_code == 200 and upstream.requests[-1].path == "/v1/models/fake-model"


def test_every_response_carries_a_request_id(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy, httpx.Client() as c:
        answers = {
            f"{method} {path}": c.request(method, proxy + path)
            for method, path in [
                ("GET", "/v1/models"),
                ("GET", "/healthz"),
                ("GET", "/readyz"),
                ("GET", "/metrics"),
                ("GET", "/ui"),
                ("GET", "/ui/data"),
                ("GET", "/nope"),
                ("GET", "/v1/chat/completions"),
                ("POST", "/v1/chat/completions"),
            ]
        }
        missing = [what for what, r in answers.items() if not r.headers.get("x-request-id")]
        assert missing == []
        assert len({r.headers["x-request-id"] for r in answers.values()}) == len(answers)
        given = c.get(f"{proxy}/healthz", headers={"x-request-id": "mine-1"})
        assert given.headers.get_list("x-request-id") == ["mine-1"]


@pytest.mark.parametrize("method", ["TRACE", "TRACK", "trace"])
def test_trace_is_never_relayed(fake: tuple[FakeUpstream, str], method: str) -> None:
    """Regression (issue 24, item 9): TRACE was passed through, and an upstream that echoes requests
    returned the upstream key to the client."""
    upstream, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        r = httpx.request(method, f"{proxy}/v1/files/x")
    assert r.status_code in (400, 405), r.status_code  # a lower-case method is not an HTTP method
    assert upstream.requests == []
