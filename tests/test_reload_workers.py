"""POST /admin/reload under `infertap serve --workers 2`: one worker answers it, every worker follows
it. Regression: only the worker that answered reloaded; the other kept routing to the old upstream."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.peers import Peers, prepare
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import serve_in_thread, serve_process, wait_until
from tests.test_reload import ADMIN, BROKEN, ENV, Conf, World, chat, headers

WORKERS = 2


def _toml(w: World, conf: Conf) -> str:
    # The page's data names the worker that answered (its pid) and what it served.
    return conf.toml(w.a_url, w.b_url).replace("[ui]\nenabled = false", "[ui]\nenabled = true")


def _served(base: str) -> dict[int, int]:
    """Proxied requests each worker has served, once /ui/data has answered from every worker (each
    call is a new connection, which either worker may accept)."""
    seen: dict[int, int] = {}

    def all_answered() -> bool:
        data = httpx.get(f"{base}/ui/data").json()
        seen[data["pid"]] = sum(data["totals"]["requests"].values())
        return len(seen) == WORKERS

    wait_until(all_answered, 60, f"/ui/data from all {WORKERS} workers")
    return seen


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[World, str]]:
    a, b = FakeUpstream(), FakeUpstream()
    with serve_in_thread(a) as a_url, serve_in_thread(b) as b_url:
        w = World(a, b, a_url + "/v1", b_url + "/v1", "", tmp_path / "config.toml")
        w.path.write_text(_toml(w, Conf(route_m_to_a=True)))
        env = {**os.environ, **ENV}
        args = ("--config", str(w.path), "--workers", str(WORKERS))
        with serve_process(*args, env=env, log=tmp_path / "serve.log") as (base, _):
            w.proxy = base
            assert set(_served(base).values()) == {0}  # every worker up, none has served yet
            yield w, base


def test_a_reload_answered_by_one_worker_applies_in_every_worker(workers: tuple[World, str]) -> None:
    w, base = workers
    w.path.write_text(_toml(w, Conf(route_m_to_a=False)))  # model m: from upstream a to b
    r = httpx.post(f"{base}/admin/reload", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {"reloaded": True, "applied": ["upstreams"], "restart_needed": [], "workers": WORKERS}

    # A broken file after it changes nothing, in any worker.
    w.path.write_text(BROKEN["negative timeout"][0])
    r = httpx.post(f"{base}/admin/reload", headers=ADMIN, timeout=10)
    assert r.status_code == 400 and "timeouts.idle" in r.text, r.text

    # Each request on a new connection, until every worker has served some: all follow the reload.
    sent = 0
    while min(_served(base).values()) == 0:
        assert sent < 200, f"{sent} requests and one worker served none: {_served(base)}"
        for _ in range(10):
            rid = f"after-{uuid.uuid4().hex}"
            resp = httpx.post(f"{base}/v1/chat/completions", json=chat(False), headers=headers("k1", rid))
            assert resp.status_code == 200, resp.text
            assert w.seen_by(rid)[0] == "b", f"request {sent} went by the old routing: {_served(base)}"
            sent += 1
    # What decided the loop counts these requests (the count lands as each one ends: wait for it).
    wait_until(lambda: sum(_served(base).values()) == sent, 30, f"{sent} requests counted")


def test_peers_publish_and_catch_up(tmp_path: Path) -> None:
    prepare(str(tmp_path))
    one, two = Peers(str(tmp_path)), Peers(str(tmp_path))
    try:
        assert not one.behind() and not two.behind()
        one.publish('{"n": 1}')
        assert not one.behind() and two.behind()
        two.publish('{"n": 2}')  # the last published wins everywhere
        assert one.behind() and not two.behind()
        assert one.take() == '{"n": 2}'
        assert not one.behind()
        three = Peers(str(tmp_path))  # a worker started later reads the file itself: not behind
        assert not three.behind()
        three.close()
    finally:
        one.close()
        two.close()
