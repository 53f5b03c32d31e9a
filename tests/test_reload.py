"""POST /admin/reload: new requests follow the new file, streams in flight finish on the old one, and
a broken file changes nothing. Real infertap, two fake upstreams, real clients, on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from proxy.app import create_app
from proxy.settings import AuthSettings, Settings, load_settings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, free_port, make_settings, serve_in_thread, serve_process, wait_until

ADMIN = {"authorization": "Bearer adm"}
ENV = {
    "RT_ADMIN": "adm",
    "RT_KEY_A": "ka",
    "RT_KEY_B1": "kb1",
    "RT_KEY_B2": "kb2",
    "RT_CLIENTS_1": "k1",
    "RT_CLIENTS_2": "k2",
}


@dataclass(frozen=True)
class Conf:
    route_m_to_a: bool = True  # model "m" goes to upstream a (else to b, the default)
    clients: int = 1  # RT_CLIENTS_<n>: the client key that is accepted
    b_key: int = 1  # RT_KEY_B<n>: the key infertap sends to upstream b
    idle: float = 30.0

    def toml(self, a: str, b: str) -> str:
        models = '["m"]' if self.route_m_to_a else '["not-m-*"]'
        return f"""
[auth]
keys_env = "RT_CLIENTS_{self.clients}"
admin_token_env = "RT_ADMIN"
[timeouts]
idle = {self.idle}
[retry]
backoff_seconds = 0
[metrics]
access_log = false
[[upstreams]]
name = "a"
base_url = "{a}"
models = {models}
api_key_env = "RT_KEY_A"
forward_headers = ["x-fake-*"]
[[upstreams]]
name = "b"
base_url = "{b}"
default = true
api_key_env = "RT_KEY_B{self.b_key}"
forward_headers = ["x-fake-*"]
"""


BROKEN = {
    "negative timeout": ("[timeouts]\nidle = -1\n", "timeouts.idle"),
    "not TOML": ("[[upstreams]\nname = ", "not valid TOML"),
    "unknown field": ("[retry]\nmax_attempt = 2\n", "retry.max_attempt"),
    "unset key variable": ('[auth]\nkeys_env = "RT_NOT_SET"\n', "auth.keys_env"),
    "an upstream's own timeout": (
        '[[upstreams]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\ntimeouts = {ttft = 0}\n',
        "upstreams.0.timeouts.ttft",
    ),
    "an upstream's own retry": (
        '[[upstreams]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\nretry = {max_attempts = 0}\n',
        "upstreams.0.retry.max_attempts",
    ),
}


@dataclass
class World:
    a: FakeUpstream
    b: FakeUpstream
    a_url: str
    b_url: str
    proxy: str
    path: Path

    def write(self, conf: Conf) -> None:
        self.path.write_text(conf.toml(self.a_url, self.b_url))

    def reload(self, conf: Conf) -> httpx.Response:
        self.write(conf)
        return httpx.post(f"{self.proxy}/admin/reload", headers=ADMIN, timeout=10)

    def seen_by(self, rid: str) -> tuple[str, str]:
        """(upstream name, the authorization it got) for request `rid`."""
        for name, up in (("a", self.a), ("b", self.b)):
            for r in up.requests:
                if r.headers.get("x-request-id") == rid:
                    return name, r.headers.get("authorization", "")
        raise AssertionError(f"no upstream saw {rid}")

    def sent_by(self, name: str, rid: str) -> bytes:
        return bytes((self.a if name == "a" else self.b).sent[rid])


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    a, b = FakeUpstream(), FakeUpstream()
    path = tmp_path / "config.toml"
    with serve_in_thread(a) as a_url, serve_in_thread(b) as b_url:
        w = World(a, b, a_url + "/v1", b_url + "/v1", "", path)
        w.write(Conf())
        app = create_app(load_settings(path), reload=lambda: load_settings(path))
        with serve_in_thread(app) as proxy:
            w.proxy = proxy
            yield w


def chat(stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}  # asked by the client: relayed unchanged
    return {**body, **extra}


def headers(key: str, rid: str, **fake: str) -> dict[str, str]:
    return {
        "authorization": f"Bearer {key}",
        "x-request-id": rid,
        **{f"x-fake-{k}": v for k, v in fake.items()},
    }


def ask(proxy: str, key: str, rid: str) -> httpx.Response:
    """A non-streaming chat request with client key `key`."""
    return httpx.post(f"{proxy}/v1/chat/completions", json=chat(False), headers=headers(key, rid))


def config_view(w: World) -> dict[str, Any]:
    r = httpx.get(f"{w.proxy}/admin/config", headers=ADMIN)
    assert r.status_code == 200
    cfg: dict[str, Any] = r.json()["config"]
    return cfg


def test_reload_applies_to_new_requests_and_streams_in_flight_finish_on_the_old(world: World) -> None:
    w = world
    with httpx.Client(timeout=30) as c:
        rid = "in-flight"
        # Gaps of 0.4 s: longer than the idle timeout the reload brings in.
        h = headers("k1", rid, events="6", **{"gap-ms": "400"})
        with c.stream("POST", f"{w.proxy}/v1/chat/completions", json=chat(True), headers=h) as s:
            it = s.iter_raw()
            got = next(it)
            while b'"content"' not in got:
                got += next(it)
            r = w.reload(Conf(route_m_to_a=False, clients=2, b_key=2, idle=0.3))
            assert r.status_code == 200, r.text
            assert r.json() == {
                "reloaded": True,
                "applied": ["upstreams", "timeouts", "auth"],
                "restart_needed": [],
                "workers": 1,
                "workers_running": 1,
            }
            # New requests: the new client keys, routing, upstream key.
            assert (
                c.post(
                    f"{w.proxy}/v1/chat/completions", json=chat(False), headers=headers("k1", "old-key")
                ).status_code
                == 401
            )
            ok = c.post(f"{w.proxy}/v1/chat/completions", json=chat(False), headers=headers("k2", "new"))
            assert ok.status_code == 200
            assert w.seen_by("new") == ("b", "Bearer kb2")
            # ... and the new idle timeout: a stream with the same gaps is cut, visibly.
            cut = c.post(
                f"{w.proxy}/v1/chat/completions",
                json=chat(True),
                headers=headers("k2", "new-stream", events="6", **{"gap-ms": "400"}),
            )
            assert b'"type":"idle_timeout"' in cut.content
            for more in it:
                got += more
    # The stream in flight: old upstream, old key, old timeouts, every byte as upstream a sent it.
    assert w.seen_by(rid) == ("a", "Bearer ka")
    assert got == w.sent_by("a", rid) and got.endswith(b"data: [DONE]\n\n")
    assert config_view(w)["timeouts"]["idle"] == 0.3


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_file_changes_nothing(world: World, broken: str) -> None:
    w = world
    assert w.reload(Conf(route_m_to_a=False, clients=2, b_key=2, idle=5)).status_code == 200
    before = config_view(w)
    text, named = BROKEN[broken]
    w.path.write_text(text)
    r = httpx.post(f"{w.proxy}/admin/reload", headers=ADMIN)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_config" and named in err["message"] and "NOT reloaded" in err["message"]
    assert config_view(w) == before
    assert ask(w.proxy, "k2", "after").status_code == 200 and w.seen_by("after") == ("b", "Bearer kb2")
    assert ask(w.proxy, "k1", "x").status_code == 401


# -- randomized: sequences of reloads, broken files, requests and streams across reloads ----------
class ReloadMachine(RuleBasedStateMachine):
    w: World

    @initialize()
    def start(self) -> None:
        self.conf = Conf()
        assert self.w.reload(self.conf).status_code == 200

    def _expect(self, conf: Conf) -> tuple[str, str]:
        return ("a", "Bearer ka") if conf.route_m_to_a else ("b", f"Bearer kb{conf.b_key}")

    @rule(route=st.booleans(), clients=st.sampled_from([1, 2]), b_key=st.sampled_from([1, 2]))
    def reload(self, route: bool, clients: int, b_key: int) -> None:
        conf = Conf(route, clients, b_key)
        r = self.w.reload(conf)
        assert r.status_code == 200, r.text
        self.conf = conf

    @rule(broken=st.sampled_from(sorted(BROKEN)))
    def broken_reload(self, broken: str) -> None:
        self.w.path.write_text(BROKEN[broken][0])
        assert httpx.post(f"{self.w.proxy}/admin/reload", headers=ADMIN).status_code == 400

    @rule(key=st.sampled_from([1, 2]))
    def request(self, key: int) -> None:
        rid = uuid.uuid4().hex
        r = httpx.post(
            f"{self.w.proxy}/v1/chat/completions", json=chat(False), headers=headers(f"k{key}", rid)
        )
        if key != self.conf.clients:
            assert r.status_code == 401
            return
        assert r.status_code == 200 and self.w.seen_by(rid) == self._expect(self.conf)

    @rule(route=st.booleans(), clients=st.sampled_from([1, 2]), b_key=st.sampled_from([1, 2]))
    def stream_across_a_reload(self, route: bool, clients: int, b_key: int) -> None:
        rid = uuid.uuid4().hex
        expected = self._expect(self.conf)
        h = headers(f"k{self.conf.clients}", rid, events="3", **{"gap-ms": "30"})
        with httpx.stream("POST", f"{self.w.proxy}/v1/chat/completions", json=chat(True), headers=h) as s:
            it = s.iter_raw()
            got = next(it)
            self.reload(route, clients, b_key)
            for more in it:
                got += more
        assert self.w.seen_by(rid) == expected
        assert got == self.w.sent_by(expected[0], rid)

    @invariant()
    def nothing_left_in_flight(self) -> None:
        ups = httpx.get(f"{self.w.proxy}/admin/upstreams", headers=ADMIN).json()
        assert all(u["in_flight"] == 0 for u in ups)

    @invariant()
    def ui_shows_the_running_configuration(self) -> None:
        assert httpx.get(f"{self.w.proxy}/ui/data").json()["config"] == config_view(self.w)


def test_reload_sequences(world: World) -> None:
    ReloadMachine.w = world
    run_state_machine_as_test(
        ReloadMachine,
        settings=settings(
            max_examples=12,
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )


def test_sighup_and_the_admin_port_on_a_real_process(tmp_path: Path, fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    admin_port = free_port()
    path = tmp_path / "config.toml"

    def write(idle: float) -> None:
        text = Conf(idle=idle).toml(url, url).replace('name = "b"', 'name = "b2"')
        path.write_text(text.replace("[timeouts]", f"[server]\nadmin_port = {admin_port}\n[timeouts]"))

    write(30.0)
    log = tmp_path / "serve.log"
    env = {**os.environ, **ENV}
    admin = f"http://127.0.0.1:{admin_port}/admin/config"
    with serve_process("--config", str(path), env=env, log=log) as (base, proc):
        assert httpx.get(f"{base}/admin/config", headers=ADMIN).status_code == 404  # not on the public port
        assert httpx.get(admin, headers=ADMIN).json()["config"]["timeouts"]["idle"] == 30.0
        write(7.0)
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: httpx.get(admin, headers=ADMIN).json()["config"]["timeouts"]["idle"] == 7.0)
        path.write_text("[timeouts]\nidle = -1\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "NOT reloaded" in log.read_text(), what="the rejection in the log")
        assert "timeouts.idle" in log.read_text()
        assert proc.poll() is None
        assert httpx.get(admin, headers=ADMIN).json()["config"]["timeouts"]["idle"] == 7.0


def test_a_reload_that_would_open_the_proxy_is_refused_unless_the_file_says_so(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 24, item 16): a reloaded file without `[auth] keys_env` opened the proxy to
    everyone; the only sign was one log line. Now the reload is refused (the running configuration
    stays) unless the file says `[auth] open = true`; /status says when the proxy is open."""
    _, url = fake
    monkeypatch.setenv("INFERTAP_TEST_OPEN_KEYS", "sk-client")
    monkeypatch.setenv("INFERTAP_TEST_OPEN_ADMIN", "admin-token")
    keyed = make_settings(("fake", url))
    keyed.auth = AuthSettings(keys_env="INFERTAP_TEST_OPEN_KEYS", admin_token_env="INFERTAP_TEST_OPEN_ADMIN")
    next_file: list[Settings] = []
    admin = {"authorization": "Bearer admin-token"}
    with serve_in_thread(create_app(keyed, reload=lambda: next_file[-1])) as proxy:
        assert httpx.get(proxy + "/status").json()["open"] is False
        for auth in (
            AuthSettings(admin_token_env="INFERTAP_TEST_OPEN_ADMIN"),  # client keys dropped
            AuthSettings(keys_env="INFERTAP_TEST_OPEN_KEYS"),  # the admin token dropped
        ):
            next_file.append(keyed.model_copy(update={"auth": auth}))
            r = httpx.post(proxy + "/admin/reload", headers=admin)
            assert r.status_code == 400 and "open = true" in r.json()["error"]["message"], r.text
            chat = httpx.post(proxy + "/v1/chat/completions", json=CHAT)
            assert chat.status_code == 401  # the running configuration stayed
        next_file.append(
            keyed.model_copy(
                update={"auth": AuthSettings(admin_token_env="INFERTAP_TEST_OPEN_ADMIN", open=True)}
            )
        )
        assert httpx.post(proxy + "/admin/reload", headers=admin).status_code == 200
        assert httpx.post(proxy + "/v1/chat/completions", json=CHAT).status_code == 200
        assert httpx.get(proxy + "/status").json()["open"] is True
