"""Replica pools end to end: several fake upstreams behind one upstream name (docs/fleet.md)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import TypeAdapter

from proxy.api.operator import UpstreamState
from proxy.app import create_app
from proxy.core.asgi import Receive, Scope, Send
from proxy.settings import Settings, UpstreamSettings, load_settings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import (
    CHAT,
    TEST_HEADERS,
    free_port,
    make_settings,
    run_proxy,
    serve_in_thread,
    wait_until,
)
from tests.promtext import samples, scrape

STREAM = {**CHAT, "stream": True}
CLOSED = "http://127.0.0.1:9/v1"  # nothing listens: connections are refused


def pool_settings(replicas: list[str], balance: str = "least_request", **extra: Any) -> Settings:
    ups = [
        UpstreamSettings(
            name="pool",
            replicas=replicas,
            balance=balance,  # type: ignore[arg-type]
            forward_headers=TEST_HEADERS,
            fallback=["fb"] if "fb" in extra else [],
        )
    ]
    if "fb" in extra:
        ups.append(UpstreamSettings(name="fb", base_url=extra.pop("fb"), forward_headers=TEST_HEADERS))
    s = Settings(upstreams=ups, **extra)
    s.retry.backoff_seconds = 0.01
    s.timeouts.ttft = 1.0
    s.timeouts.idle = 1.0
    return s


@contextmanager
def fakes(n: int) -> Iterator[list[tuple[FakeUpstream, str]]]:
    with ExitStack() as stack:
        out = []
        for _ in range(n):
            f = FakeUpstream()
            out.append((f, stack.enter_context(serve_in_thread(f)) + "/v1"))
        yield out


class Stalling:
    """A replica that sends its role chunk and then nothing (a stall before the first token)."""

    def __init__(self, inner: FakeUpstream) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, "headers": [*scope["headers"], (b"x-fake-hang", b"after-role")]}
        await self.inner(scope, receive, send)


class Killable:
    """A fake upstream on a fixed port that can be stopped (connections refused) and started again."""

    def __init__(self) -> None:
        self.app = FakeUpstream()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", loop="asyncio"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        server = self.server
        wait_until(lambda: server.started, what="replica start")

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(timeout=10)


def post(proxy: str, body: dict[str, object], **headers: str) -> httpx.Response:
    return httpx.post(f"{proxy}/v1/chat/completions", json=body, headers=headers, timeout=30)


def replica_states(proxy: str) -> dict[str, str]:
    rows = httpx.get(f"{proxy}/status", timeout=10).json()["upstreams"]
    return {r["address"]: r["state"] for up in rows for r in up.get("replicas", [])}


def test_round_robin_spreads_evenly() -> None:
    with fakes(3) as ups, run_proxy(pool_settings([u for _, u in ups], "round_robin")) as proxy:
        for _ in range(6):
            assert post(proxy, CHAT).status_code == 200
    assert [len(f.requests) for f, _ in ups] == [2, 2, 2]


def test_least_request_sends_to_the_idle_replica() -> None:
    with fakes(2) as ups, run_proxy(pool_settings([u for _, u in ups])) as proxy:
        with httpx.Client(timeout=30) as client:
            held = threading.Event()

            def slow() -> None:
                with client.stream(
                    "POST", f"{proxy}/v1/chat/completions", json=STREAM, headers={"x-fake-gap-ms": "50"}
                ) as r:
                    for _ in r.iter_bytes():
                        held.set()

            t = threading.Thread(target=slow)
            t.start()
            wait_until(held.is_set, what="a stream in flight")
            busy = [len(f.requests) for f, _ in ups]
            assert post(proxy, CHAT).status_code == 200
            after = [len(f.requests) for f, _ in ups]
            t.join()
    # The second request went to the replica the held stream was not on.
    assert busy.index(1) != [a - b for a, b in zip(after, busy, strict=True)].index(1)


def test_prefix_affinity_keeps_a_conversation_on_one_replica() -> None:
    with fakes(3) as ups, run_proxy(pool_settings([u for _, u in ups], "prefix_affinity")) as proxy:
        where: dict[int, set[int]] = {}
        for turn in range(3):
            for conv in range(6):
                history: list[dict[str, str]] = [
                    {"role": "system", "content": f"You are assistant number {conv}."},
                    {"role": "user", "content": f"conversation {conv} starts"},
                ]
                for t in range(turn):
                    history += [
                        {"role": "assistant", "content": f"a{t}"},
                        {"role": "user", "content": f"u{t}"},
                    ]
                before = [len(f.requests) for f, _ in ups]
                assert post(proxy, {**CHAT, "messages": history}).status_code == 200
                got = [len(f.requests) - b for (f, _), b in zip(ups, before, strict=True)].index(1)
                where.setdefault(conv, set()).add(got)
        # And a session header names a conversation whatever its messages.
        sessions = set()
        for i in range(4):
            before = [len(f.requests) for f, _ in ups]
            body = {**CHAT, "messages": [{"role": "user", "content": f"different {i}"}]}
            assert post(proxy, body, **{"x-session-id": "abc"}).status_code == 200
            sessions.add([len(f.requests) - b for (f, _), b in zip(ups, before, strict=True)].index(1))
    assert all(len(replicas) == 1 for replicas in where.values()), where
    assert len(set().union(*where.values())) > 1  # and the conversations spread over the pool
    assert len(sessions) == 1


@pytest.mark.parametrize("broken", ["refused", "stall"])
def test_a_failure_before_the_first_token_goes_to_another_replica_before_the_fallback(broken: str) -> None:
    stalls = FakeUpstream()
    with fakes(2) as (good, fb), ExitStack() as stack:
        bad = (
            CLOSED if broken == "refused" else stack.enter_context(serve_in_thread(Stalling(stalls))) + "/v1"
        )
        settings = pool_settings([bad, good[1]], "round_robin", fb=fb[1])
        with run_proxy(settings) as proxy:
            r = post(proxy, STREAM)
            status = httpx.get(f"{proxy}/status", timeout=10).json()
    assert r.status_code == 200 and "data: [DONE]" in r.text
    assert len(good[0].requests) == 1 and len(fb[0].requests) == 0
    assert len(stalls.requests) == (broken == "stall")
    pool = status["upstreams"][0]
    assert all(row["in_flight"] == 0 for row in pool["replicas"])


def test_a_killed_replica_is_ejected_then_readmitted() -> None:
    dying = Killable()
    dying.start()
    with fakes(1) as ups:
        settings = pool_settings([dying.url, ups[0][1]], "round_robin")
        settings.circuit.min_calls = 2
        settings.circuit.cooldown_seconds = 0.2
        with run_proxy(settings) as proxy:
            assert post(proxy, CHAT).status_code == 200
            dying.stop()
            address = dying.url

            # Every request still succeeds (retried on the other replica) until the dead one is out.
            def ejected() -> bool:
                assert post(proxy, CHAT).status_code == 200
                return replica_states(proxy)[address] == "ejected"

            wait_until(ejected, what="the dead replica ejected")
            dying.start()

            def readmitted() -> bool:
                assert post(proxy, CHAT).status_code == 200
                return replica_states(proxy)[address] == "up"

            wait_until(readmitted, what="the replica readmitted")
        assert len(dying.app.requests) >= 2  # before it died, and the probe that readmitted it
    dying.stop()


def test_a_stream_flowing_from_a_replica_that_dies_ends_with_the_error_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="infertap.access")
    with fakes(2) as ups, run_proxy(pool_settings([u for _, u in ups], "round_robin")) as proxy:
        r = post(proxy, STREAM, **{"x-fake-cut": "2", "x-request-id": "cut1"})
        status = httpx.get(f"{proxy}/status", timeout=10).json()
        wait_until(lambda: any("cut1" in x.getMessage() for x in caplog.records), what="the access-log line")
    assert r.status_code == 200
    assert '"stream_interrupted"' in r.text and ups[0][1].removeprefix("http://") in r.text
    assert sum(len(f.requests) for f, _ in ups) == 1  # committed: never retried
    assert all(row["in_flight"] == 0 for row in status["upstreams"][0]["replicas"])
    (line,) = [x.getMessage() for x in caplog.records if "cut1" in x.getMessage()]
    assert json.loads(line)["replica"] == ups[0][1]


def test_the_pool_series() -> None:
    with fakes(2) as ups:
        settings = pool_settings([CLOSED, ups[0][1], ups[1][1]], "round_robin")
        with run_proxy(settings) as proxy:
            for _ in range(3):
                assert post(proxy, STREAM).status_code == 200
            text = scrape(proxy)
    got = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples(text)}

    def v(name: str, **labels: str) -> float:
        return got.get((name, tuple(sorted({"upstream": "pool", **labels}.items()))), 0.0)

    dead, live = CLOSED, [u for _, u in ups]
    # The refused attempts counted on their replica, the answering ones on theirs; all back to 0.
    refused = v("infertap_replica_requests_total", replica=dead, outcome="connect_error")
    retries = v("infertap_balance_decisions_total", policy="round_robin", reason="retry")
    assert refused >= 1 and retries == refused
    assert sum(v("infertap_replica_requests_total", replica=a, outcome="ok") for a in live) == 3
    assert all(v("infertap_replica_in_flight_requests", replica=a) == 0 for a in [dead, *live])
    assert sum(v("infertap_replica_time_to_first_token_seconds_count", replica=a) for a in live) == 3
    first = sum(
        v("infertap_balance_decisions_total", policy="round_robin", reason=r)
        for r in ("round_robin", "ejected")
    )
    assert first == 3
    assert v("infertap_replica_up", replica=live[0]) == 1


def test_a_single_upstream_has_no_pool_series(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("one", url))) as proxy:
        assert post(proxy, STREAM).status_code == 200
        text = scrape(proxy)
    assert not [n for n, _, _ in samples(text) if n.startswith(("infertap_replica_", "infertap_balance_"))]


def test_a_reload_changes_the_pool_and_a_stream_in_flight_finishes_on_its_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_ADMIN", "adm")
    path = tmp_path / "config.toml"

    def write(replicas: list[str]) -> None:
        path.write_text(
            '[auth]\nadmin_token_env = "POOL_ADMIN"\n[[upstreams]]\nname = "pool"\nbalance = "round_robin"\n'
            f'forward_headers = ["x-fake-*"]\nreplicas = {json.dumps(replicas)}\n'
        )

    with fakes(3) as ups:
        (a, a_url), (b, b_url), (c, c_url) = ups
        write([a_url, b_url])
        app = create_app(load_settings(path), reload=lambda: load_settings(path))
        with serve_in_thread(app) as proxy, httpx.Client(timeout=30) as client:
            got: list[bytes] = []
            first = threading.Event()

            def slow() -> None:  # round robin: the first request goes to a
                headers = {"x-fake-events": "20", "x-fake-gate": "reloaded"}
                with client.stream("POST", f"{proxy}/v1/chat/completions", json=STREAM, headers=headers) as r:
                    for chunk in r.iter_bytes():
                        got.append(chunk)
                        first.set()

            t = threading.Thread(target=slow)
            t.start()
            wait_until(first.is_set, what="a stream from replica a")
            write([b_url, c_url])  # a leaves the pool, c joins
            r = httpx.post(f"{proxy}/admin/reload", headers={"authorization": "Bearer adm"}, timeout=10)
            assert r.status_code == 200
            states = {row["address"]: (row["state"], row["in_flight"]) for row in replica_rows(proxy)}
            assert states[a_url] == ("draining", 1)
            a.open_gate("reloaded")
            for _ in range(4):
                assert post(proxy, CHAT).status_code == 200
            t.join()
            after = {row["address"]: row for row in replica_rows(proxy)}
            up = {lab["replica"]: v for n, lab, v in samples(scrape(proxy)) if n == "infertap_replica_up"}
    assert up == {a_url: 0, b_url: 1, c_url: 1}
    assert b"data: [DONE]" in b"".join(got)  # the stream in flight finished on a
    assert len(a.requests) == 1 and len(b.requests) + len(c.requests) == 4 and len(c.requests) >= 1
    assert a_url not in after and all(row["in_flight"] == 0 for row in after.values())


def replica_rows(proxy: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = httpx.get(f"{proxy}/status", timeout=10).json()["upstreams"][0]["replicas"]
    return rows


def test_the_operator_views_list_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOL_ADMIN", "adm")
    with fakes(2) as ups:
        settings = pool_settings([CLOSED, *(u for _, u in ups)], "prefix_affinity")
        settings.auth.admin_token_env = "POOL_ADMIN"
        settings.circuit.min_calls = 1
        with run_proxy(settings) as proxy:
            for i in range(4):
                body = {**CHAT, "messages": [{"role": "user", "content": f"conversation {i}"}]}
                assert post(proxy, {**body, "stream": True}).status_code == 200
            admin = httpx.get(f"{proxy}/admin/upstreams", headers={"authorization": "Bearer adm"}, timeout=10)
            ui = httpx.get(f"{proxy}/ui/data", timeout=10).json()
    (pool,) = TypeAdapter(list[UpstreamState]).validate_python(admin.json())
    assert pool.balance == "prefix_affinity" and pool.replicas is not None
    rows = {r.address: r for r in pool.replicas}
    assert set(rows) == {CLOSED, *(u for _, u in ups)} and all(r.in_flight == 0 for r in rows.values())
    assert {r.state for a, r in rows.items() if a != CLOSED} == {"up"}
    served = [rows[u] for _, u in ups if rows[u].ttft_seconds is not None]
    assert served  # the replicas that answered have a recent TTFT
    (shown,) = ui["upstreams"]
    assert shown["balance"] == "prefix_affinity" and {r["address"] for r in shown["replicas"]} == set(rows)
