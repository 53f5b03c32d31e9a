"""/ui follows a reload: the configuration panel, the upstreams table, the model allow-list and the
page's token are the ones new requests follow, with every secret still hidden. A real `infertap
serve --config FILE`, a fake upstream, real clients, on 127.0.0.1."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import free_port, serve_process, wait_until
from tests.promtext import value
from tests.test_reload import ADMIN, ENV
from tests.test_ui import chat, ui_data

SECRETS = {"UR_METRICS_1": "ur-metrics-1", "UR_METRICS_2": "ur-metrics-2", "UR_KEY": "sk-ur-upstream"}


def config_file(admin_port: int, url: str, name: str, idle: float, token: int, models: str) -> str:
    return f"""
[server]
admin_port = {admin_port}
[auth]
admin_token_env = "RT_ADMIN"
metrics_token_env = "UR_METRICS_{token}"
[timeouts]
idle = {idle}
[metrics]
access_log = false
[[upstreams]]
name = "{name}"
base_url = "{url}"
models = ["{models}"]
api_key_env = "UR_KEY"
headers = {{ "x-team" = "ur-header-secret" }}
"""


def test_ui_shows_the_reloaded_configuration_without_secrets(
    tmp_path: Path, fake: tuple[FakeUpstream, str]
) -> None:
    _, url = fake
    admin_port = free_port()
    path = tmp_path / "config.toml"
    path.write_text(config_file(admin_port, url, "first", 30.0, 1, "old-*"))
    admin = f"http://127.0.0.1:{admin_port}/admin"
    old = {"authorization": f"Bearer {SECRETS['UR_METRICS_1']}"}
    new = {"authorization": f"Bearer {SECRETS['UR_METRICS_2']}"}

    def reload(name: str, idle: float, token: int, models: str) -> None:
        path.write_text(config_file(admin_port, url, name, idle, token, models))
        r = httpx.post(f"{admin}/reload", headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text

    def shown(auth: dict[str, str]) -> dict[str, Any]:
        """/ui/data at once after a reload (not once the page's shared answer expires)."""
        r = httpx.get(f"{base}/ui/data", headers=auth)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        assert data["config"] == httpx.get(f"{admin}/config", headers=ADMIN).json()["config"]
        for secret in (*SECRETS.values(), "ur-header-secret"):
            assert secret not in r.text, secret
        return data

    env = {**os.environ, **ENV, **SECRETS}
    with serve_process("--config", str(path), env=env, log=tmp_path / "serve.log") as (base, _):
        before = shown(old)
        assert [u["name"] for u in before["config"]["upstreams"]] == ["first"]
        assert before["config"]["timeouts"]["idle"] == 30.0 and before.get("config_reloaded_at") is None

        reload("second", 7.0, 1, "new-*")
        after = shown(old)
        assert [u["name"] for u in after["config"]["upstreams"]] == ["second"]
        assert after["config"]["upstreams"][0]["models"] == ["new-*"]
        assert after["config"]["upstreams"][0]["headers"] == {"x-team": "(hidden)"}
        assert after["config"]["timeouts"]["idle"] == 7.0
        assert [(u["name"], u["models"], u["api_key_set"]) for u in after["upstreams"]] == [
            ("second", ["new-*"], True)
        ]
        assert after["config_reloaded_at"] is not None and "upstreams" in after["config_reloadable"]

        # The model allow-list (the upstreams' patterns without [metrics] models) follows too.
        ok = httpx.post(f"{base}/v1/chat/completions", json=chat("new-1"), timeout=10)
        assert ok.status_code == 200, ok.text
        wait_until(lambda: ui_data(base, **old)["totals"]["requests"].get("ok") == 1, what="its end")
        assert list(ui_data(base, **old)["latency"]) == ["new-1"]
        metrics = httpx.get(f"{base}/metrics", headers=old).text
        assert value(metrics, "infertap_requests_total", model="new-1", outcome="ok") == 1
        assert value(metrics, "infertap_requests_total", model="other") == 0

        # The page's token is the reloaded one, as for /metrics.
        reload("second", 7.0, 2, "new-*")
        for where in ("/ui", "/ui/data", "/metrics"):
            assert httpx.get(f"{base}{where}", headers=old).status_code == 401, where
            assert httpx.get(f"{base}{where}", headers=new).status_code == 200, where
        assert shown(new)["config"]["auth"]["metrics_token_env"] == "UR_METRICS_2"


def test_an_upstream_whose_circuit_starts_anew_shows_up_after_a_reload(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[FakeUpstream, str]
) -> None:
    """The reload gives an upstream with a new base URL (or every one, when [circuit] changed) a
    new, closed circuit; /ui's upstreams table said "circuit_open" for it until traffic said
    otherwise. One kept at the same URL keeps its circuit, open or not. Through the real reload:
    POST /admin/reload on an in-process app whose loader returns the next configuration."""
    from proxy.app import create_app
    from proxy.settings import AuthSettings, CircuitSettings, RetrySettings, Settings, UpstreamSettings
    from tests.conftest import serve_in_thread
    from tests.test_circuit import CLOSED_PORT

    _, url = fake
    monkeypatch.setenv("RT_ADMIN", "adm")

    def conf(b_url: str, min_calls: int = 1) -> Settings:
        ups = [
            UpstreamSettings(name="a", base_url=CLOSED_PORT, models=["a-*"]),
            UpstreamSettings(name="b", base_url=b_url, models=["b-*"]),
        ]
        return Settings(
            upstreams=ups,
            auth=AuthSettings(admin_token_env="RT_ADMIN"),
            retry=RetrySettings(max_attempts=1),
            circuit=CircuitSettings(min_calls=min_calls, cooldown_seconds=600, when_all_open="refuse"),
        )

    current = [conf(CLOSED_PORT)]
    app = create_app(current[0], reload=lambda: current[0])
    with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as c:

        def states() -> dict[str, str]:
            return {row["name"]: row["state"] for row in ui_data(base)["upstreams"]}

        def reload(settings: Settings) -> None:
            current[0] = settings
            assert c.post("/admin/reload", headers=ADMIN).status_code == 200

        for model in ("a-1", "b-1"):  # nothing listens: one refused request opens each circuit
            assert c.post("/v1/chat/completions", json=chat(model)).status_code == 502
        assert states() == {"a": "circuit_open", "b": "circuit_open"}
        reload(conf(url))  # b at a new base URL: a new circuit; a kept as it was
        assert states() == {"a": "circuit_open", "b": "up"}
        reload(conf(url, min_calls=3))  # [circuit] changed: every circuit starts anew
        assert states() == {"a": "up", "b": "up"}
