"""POST /admin/reload under `infertap serve --workers 2`: one worker answers it, every worker follows
it. Regression: only the worker that answered reloaded; the other kept routing to the old upstream."""

from __future__ import annotations

import os
import signal
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from proxy.control.reload import Access, Reloader, adopt_published, publish_reload
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
    assert r.json() == {
        "reloaded": True,
        "applied": ["upstreams"],
        "restart_needed": [],
        "workers": WORKERS,  # both had applied it when the answer was sent
        "workers_running": WORKERS,
    }

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
        three = Peers(str(tmp_path))  # a worker started later is behind what was published
        assert three.behind() and three.take() == '{"n": 2}'
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
    """Reloads (good and broken files) on random workers of three and by SIGHUP to the supervisor,
    requests on random workers, workers replaced (as uvicorn replaces one that died) while the file
    may be broken: every request follows the last reload that succeeded, wherever it was answered,
    and a reload's acknowledgements count exactly the workers that have applied it."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        prepare(self.dir.name)
        self.path = Path(self.dir.name) / "config.toml"
        self.path.write_text(_file("a", 30))
        self.start = load_settings(self.path)  # what the supervisor hands every worker
        self.expected = ("a", 30.0)
        self.supervisor = Peers(self.dir.name, worker=False)
        self.generation = 0
        self.applied: set[int] = {0, 1, 2}  # the workers that run the last generation published
        self.workers: list[tuple[_Worker, Reloader]] = [self._start() for _ in range(3)]

    def _start(self) -> tuple[_Worker, Reloader]:
        """A worker as proxy/server/workers.py starts one."""
        peers = Peers(self.dir.name)
        worker = _Worker(adopt_published(self.start, peers))
        reloader = Reloader(worker, lambda: load_settings(self.path))
        reloader.peers = peers
        return worker, reloader

    def _write(self, to: str, idle: int, broken: bool) -> None:
        self.path.write_text(_file(to, -idle if broken else idle))

    @rule(i=st.integers(0, 2), to=st.sampled_from("ab"), idle=st.integers(1, 60), broken=st.booleans())
    def reload(self, i: int, to: str, idle: int, broken: bool) -> None:
        worker, reloader = self.workers[i]
        worker.handle(reloader)  # the POST is a request too: the worker catches up first
        self.applied.add(i)
        self._write(to, idle, broken)
        if broken:
            with pytest.raises(ConfigError, match="timeouts.idle"):
                reloader.reload()
        else:
            applied = reloader.reload()
            self.generation += 1
            assert applied.generation == self.generation
            self.expected, self.applied = (to, float(idle)), {i}

    @rule(to=st.sampled_from("ab"), idle=st.integers(1, 60), broken=st.booleans())
    def sighup(self, to: str, idle: int, broken: bool) -> None:
        """SIGHUP to the supervisor: it loads, checks and publishes; it applies nothing itself."""
        self._write(to, idle, broken)
        if broken:
            with pytest.raises(ConfigError, match="timeouts.idle"):
                publish_reload(self.supervisor, self.start, lambda: load_settings(self.path))
        else:
            generation, _ = publish_reload(self.supervisor, self.start, lambda: load_settings(self.path))
            self.generation += 1
            assert generation == self.generation
            self.expected, self.applied = (to, float(idle)), set()

    @rule(i=st.integers(0, 2))
    def request(self, i: int) -> None:
        worker, reloader = self.workers[i]
        assert (worker.handle(reloader), worker.settings.timeouts.idle) == self.expected
        self.applied.add(i)

    @rule(i=st.integers(0, 2), broken_file=st.booleans())
    def replace_worker(self, i: int, broken_file: bool) -> None:
        """Worker i dies and a new one starts, the file perhaps broken (or edited) meanwhile: it
        runs what the others run, at once."""
        _, reloader = self.workers.pop(i)
        assert reloader.peers is not None
        reloader.peers.close()
        self.applied.discard(i)
        self._write("b" if self.expected[0] == "a" else "a", 7, broken_file)
        worker, reloader = self._start()
        self.workers.insert(i, (worker, reloader))
        assert (worker.routing.route("m").name, worker.settings.timeouts.idle) == self.expected
        self.applied.add(i)

    @invariant()
    def acknowledgements(self) -> None:
        assert self.supervisor.acknowledged(self.generation) == (len(self.applied), 3)

    def teardown(self) -> None:
        for _, reloader in self.workers:
            assert reloader.peers is not None
            reloader.peers.close()
        self.supervisor.close()
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


def _waiting_for_lock(path: Path) -> bool:
    """Whether some process or thread is blocked on a flock of `path` (Linux: /proc/locks)."""
    inode = f":{path.stat().st_ino} "
    with open("/proc/locks") as f:
        return any("->" in line and inode in line for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's /proc/locks")
def test_two_reloads_at_once_end_on_the_file_read_last(tmp_path: Path) -> None:
    """Worker 1 reads the file; it is edited and worker 2's reload starts before worker 1 published.
    Regression: the lock was held only to publish, so worker 2 published the new file and worker 1
    then the old one over it: every worker ended on the older file, while worker 2's POST had
    answered 200. Now worker 2 waits for the lock from before it reads the file."""
    prepare(str(tmp_path))
    path = tmp_path / "config.toml"
    path.write_text(_file("a", 30))
    second_loaded = threading.Event()
    errors: list[BaseException] = []

    def second_load() -> Settings:
        settings = load_settings(path)
        second_loaded.set()
        return settings

    def second_reload() -> None:
        try:
            second.reload()
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    racing = threading.Thread(target=second_reload)

    def first_load() -> Settings:
        settings = load_settings(path)  # the older file
        path.write_text(_file("b", 2))  # edited, and reloaded again, while this reload goes on
        racing.start()
        wait_until(
            lambda: second_loaded.is_set() or _waiting_for_lock(tmp_path / "generation"),
            10,
            "the second reload to read the file or to wait for the lock",
        )
        return settings

    workers = [_Worker(load_settings(path)) for _ in range(3)]
    loads = (first_load, second_load, lambda: load_settings(path))
    first, second, follower = (Reloader(w, load) for w, load in zip(workers, loads, strict=True))
    for r in (first, second, follower):
        r.peers = Peers(str(tmp_path))
    try:
        path.write_text(_file("a", 1))
        first.reload()
        racing.join(10)
        assert not errors, errors
        for worker, reloader in zip(workers, (first, second, follower), strict=True):
            assert (worker.handle(reloader), worker.settings.timeouts.idle) == ("b", 2.0)
    finally:
        for r in (first, second, follower):
            assert r.peers is not None
            r.peers.close()


def test_the_idle_poll_survives_any_failure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: an unexpected exception in the idle worker's poll stopped its timer for good, and
    the worker missed every later reload until its next request."""
    from proxy.app import create_app
    from tests.conftest import make_settings

    prepare(str(tmp_path))
    first = make_settings(("a", "http://127.0.0.1:9/v1"))
    app = create_app(first, reload=lambda: first)
    app.share_reloads(Peers(str(tmp_path)))
    other = Peers(str(tmp_path))
    runtime = app.runtime
    follow = runtime.follow_peers
    failures = [RuntimeError("an unexpected failure"), MemoryError()]

    def failing() -> None:
        if failures:
            raise failures.pop(0)
        follow()

    try:
        with serve_in_thread(app):
            runtime.follow_peers = failing  # type: ignore[method-assign]
            wait_until(lambda: not failures, 5, "the poll to meet both failures")
            other.publish(make_settings(("b", "http://127.0.0.1:9/v1")).model_dump_json())
            wait_until(lambda: [up.name for up in app.settings.upstreams] == ["b"], 5, "the idle worker")
    finally:
        other.close()
    said = [r for r in caplog.records if "still polling" in r.getMessage()]
    assert len(said) == 1, "said once, not twice a second"


def test_the_answer_counts_the_workers_that_applied_the_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`workers` in the answer is acknowledgements. Regression: it was the configured number of
    workers, whether or not they had applied it (here: one that never does, as a worker whose
    event loop is blocked)."""
    from proxy.app import create_app
    from tests.conftest import make_settings

    monkeypatch.setenv("RT_ADMIN", "adm")
    prepare(str(tmp_path))
    settings = make_settings(
        ("a", "http://127.0.0.1:9/v1"), server={"workers": 2}, auth={"admin_token_env": "RT_ADMIN"}
    )
    second = settings.model_copy(
        update={"upstreams": make_settings(("b", "http://127.0.0.1:9/v1")).upstreams}
    )
    app = create_app(settings, reload=lambda: second)
    app.share_reloads(Peers(str(tmp_path)))
    stuck = Peers(str(tmp_path))  # a running worker that applies nothing
    try:
        with serve_in_thread(app) as base:
            r = httpx.post(f"{base}/admin/reload", headers=ADMIN, timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["workers"] == 1, r.json()  # the one that answered
            assert r.json()["workers_running"] == 2
            stuck.take()
            stuck.ack()  # it caught up
            assert stuck.acknowledged(stuck.seen) == (2, 2)
    finally:
        stuck.close()
    lone = Peers(str(tmp_path))
    try:
        assert lone.acknowledged(0) == (1, 1)  # the app's slot and the stuck one's were freed at exit
    finally:
        lone.close()


def _routes(w: World, base: str, before: set[str] | None = None) -> dict[str, set[str]]:
    """Where model m goes, per worker (told apart by its request ids' prefix): requests on new
    connections until every worker has answered some (and, given `before`, one that is new)."""
    seen: dict[str, set[str]] = {}

    def every_worker() -> bool:
        r = httpx.post(
            f"{base}/v1/chat/completions", json=chat(False), headers={"authorization": "Bearer k1"}
        )
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        seen.setdefault(rid.rsplit("-", 1)[0], set()).add(w.seen_by(rid)[0])
        return len(seen) == WORKERS and (before is None or bool(set(seen) - before))

    wait_until(every_worker, 60, f"requests answered by all {WORKERS} workers")
    return seen


def test_a_replaced_worker_runs_what_the_others_run(tmp_path: Path) -> None:
    """A worker that dies is replaced by uvicorn while the file is broken. Regression: the new
    worker read the file, found it broken and ran the start-up settings, undoing the reload in that
    one worker (model m back on upstream a). Also: SIGHUP to the supervisor reloads as POST does (a
    broken file changes nothing; uvicorn's own SIGHUP restarted every worker into the start-up
    settings), and the published settings are readable by infertap's user alone."""
    a, b = FakeUpstream(), FakeUpstream()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with serve_in_thread(a) as a_url, serve_in_thread(b) as b_url:
        w = World(a, b, a_url + "/v1", b_url + "/v1", "", tmp_path / "config.toml")
        w.write(Conf(route_m_to_a=True))
        env = {**os.environ, **ENV, "TMPDIR": str(tmp)}
        log = tmp_path / "serve.log"
        args = ("--config", str(w.path), "--workers", str(WORKERS))
        with serve_process(*args, env=env, log=log) as (base, proc):
            w.proxy = base
            assert w.reload(Conf(route_m_to_a=False)).status_code == 200  # m: from a to b
            routes = _routes(w, base)
            assert set().union(*routes.values()) == {"b"}, routes

            w.path.write_text(BROKEN["negative timeout"][0])
            os.kill(json_pid(base), signal.SIGKILL)
            routes = _routes(w, base, set(routes))  # the replacement has answered too
            assert set().union(*routes.values()) == {"b"}, routes

            proc.send_signal(signal.SIGHUP)
            rejected = "SIGHUP: the configuration was NOT reloaded"
            wait_until(lambda: rejected in log.read_text(), 30, "the broken file's rejection")
            routes = _routes(w, base)
            assert set().union(*routes.values()) == {"b"}, routes

            w.write(Conf(route_m_to_a=True))  # m: back to a, by SIGHUP
            proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "SIGHUP: configuration reloaded" in log.read_text(), 30, "the SIGHUP reload")
            routes = _routes(w, base)
            assert set().union(*routes.values()) == {"a"}, routes

            shared = next(tmp.glob("infertap-reload-*"))
            assert stat.S_IMODE(shared.stat().st_mode) == 0o700
            assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in shared.iterdir()} == {
                "generation": 0o600,
                "settings.json": 0o600,
            }


def json_pid(base: str) -> int:
    pid: int = httpx.get(f"{base}/ui/data").json()["pid"]
    return pid


def test_the_published_settings_are_readable_by_infertaps_user_alone(tmp_path: Path) -> None:
    """They hold what infertap redacts everywhere else (a base URL's user info and query, upstream
    header values). Regression: settings.json was created as the umask allowed (0644)."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    umask = os.umask(0)  # the most permissive there is: the files must not follow it
    try:
        prepare(str(shared))
        one = Peers(str(shared))
        try:
            one.publish('{"upstreams": [{"base_url": "http://user:secret@127.0.0.1:9/v1"}]}')
        finally:
            one.close()
    finally:
        os.umask(umask)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in shared.iterdir()} == {
        "generation": 0o600,
        "settings.json": 0o600,
    }
