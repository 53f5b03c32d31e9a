"""POST /admin/reload under `infertap serve --workers 2`: one worker answers it, every worker follows
it. Regression: only the worker that answered reloaded; the other kept routing to the old upstream."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from proxy.control.reload import Access, Reloader
from proxy.control.reload_sharing import Peers, prepare
from proxy.core.model_routing import ModelRouter
from proxy.settings import ConfigError, Settings, load_settings
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


class _Worker:
    """A reload target as a worker's app is one (proxy.control.reload.Target), without the server."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.routing = ModelRouter.from_settings(settings)
        self.memory: set[str] = set()

    def swap(self, settings: Settings, access: Access, routing: ModelRouter) -> None:
        self.settings, self.routing = settings, routing

    def stream_options_memory(self) -> set[str]:
        return self.memory

    def handle(self, reloader: Reloader) -> str:
        """What the app does before each request, then where model m goes."""
        assert reloader.peers is not None
        if reloader.peers.behind():
            reloader.catch_up()
        return self.routing.route("m").name


def _file(to: str, idle: int) -> str:
    """Model m goes to upstream `to`."""
    model = "m" if to == "a" else "x"
    return (
        f"[timeouts]\nidle = {idle}\n"
        f'[[upstreams]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\nmodels = ["{model}"]\n'
        '[[upstreams]]\nname = "b"\nbase_url = "http://127.0.0.1:10/v1"\ndefault = true\n'
    )


class ReloadsAcrossWorkers(RuleBasedStateMachine):
    """Reloads (good and broken files) on random workers of three, requests on random workers: every
    request follows the last reload that succeeded, wherever it was answered."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        prepare(self.dir.name)
        self.path = Path(self.dir.name) / "config.toml"
        self.path.write_text(_file("a", 30))
        self.expected = ("a", 30.0)
        self.workers: list[tuple[_Worker, Reloader]] = []
        for _ in range(3):
            worker = _Worker(load_settings(self.path))
            reloader = Reloader(worker, lambda: load_settings(self.path))
            reloader.peers = Peers(self.dir.name)
            self.workers.append((worker, reloader))

    @rule(i=st.integers(0, 2), to=st.sampled_from("ab"), idle=st.integers(1, 60), broken=st.booleans())
    def reload(self, i: int, to: str, idle: int, broken: bool) -> None:
        worker, reloader = self.workers[i]
        worker.handle(reloader)  # the POST is a request too: the worker catches up first
        self.path.write_text(_file(to, -idle if broken else idle))
        if broken:
            with pytest.raises(ConfigError, match="timeouts.idle"):
                reloader.reload()
        else:
            reloader.reload()
            self.expected = (to, float(idle))

    @rule(i=st.integers(0, 2))
    def request(self, i: int) -> None:
        worker, reloader = self.workers[i]
        assert (worker.handle(reloader), worker.settings.timeouts.idle) == self.expected

    def teardown(self) -> None:
        for _, reloader in self.workers:
            assert reloader.peers is not None
            reloader.peers.close()
        self.dir.cleanup()


def test_reloads_across_workers() -> None:
    run_state_machine_as_test(ReloadsAcrossWorkers, settings=settings(max_examples=50, deadline=None))


def test_an_idle_worker_follows_another_workers_reload(tmp_path: Path) -> None:
    """No request reaches this worker: it still follows the reload another worker published, by
    polling (its background checks and its share of the metrics would otherwise keep the old
    configuration until its next request)."""
    from proxy.app import create_app
    from tests.conftest import make_settings

    prepare(str(tmp_path))
    first = make_settings(("a", "http://127.0.0.1:9/v1"))
    second = make_settings(("b", "http://127.0.0.1:9/v1"))
    app = create_app(first, reload=lambda: first)
    app.share_reloads(Peers(str(tmp_path)))
    other = Peers(str(tmp_path))
    try:
        with serve_in_thread(app):
            other.publish(second.model_dump_json())
            wait_until(lambda: [up.name for up in app.settings.upstreams] == ["b"], 5, "the idle worker")
    finally:
        other.close()
