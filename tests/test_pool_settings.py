"""`[[upstreams]] replicas`: a pool's configuration, checked when the file loads, with errors that
say what to write instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.core.model_routing import ModelRouter
from proxy.settings import ConfigError, Settings, UpstreamSettings, load_settings, public_config


def load(tmp_path: Path, body: str) -> Settings:
    path = tmp_path / "config.toml"
    path.write_text('[[upstreams]]\nname = "qwen"\n' + body)
    return load_settings(path)


def test_a_list_of_replicas_is_a_pool(tmp_path: Path) -> None:
    s = load(
        tmp_path,
        'replicas = ["http://10.0.0.11:8000/v1/", "http://10.0.0.12:8000/v1"]\nbalance = "prefix_affinity"\n',
    )
    up = s.upstreams[0]
    assert up.replicas == ["http://10.0.0.11:8000/v1", "http://10.0.0.12:8000/v1"]
    assert (up.balance, up.balance_load_factor) == ("prefix_affinity", 0.25)
    assert up.session_header == "x-session-id"
    pool = ModelRouter.from_settings(s).upstreams[0].replicas
    assert pool is not None and [r.url for r in pool.members] == up.replicas


def test_a_dns_pool(tmp_path: Path) -> None:
    dns = "dns://vllm.llm.svc.cluster.local:8000/v1"
    s = load(tmp_path, f'replicas = ["{dns}"]\ndiscovery_interval_seconds = 2')
    target = s.upstreams[0].dns()
    assert target == ("vllm.llm.svc.cluster.local", 8000, "/v1")
    assert target is not None and target.replica_url("10.1.2.3") == "http://10.1.2.3:8000/v1"
    assert target.replica_url("fd00::1") == "http://[fd00::1]:8000/v1"
    pool = ModelRouter.from_settings(s).upstreams[0].replicas
    assert pool is not None and pool.members == [] and pool.dns == target  # filled by discovery


def test_base_url_alone_is_no_pool(tmp_path: Path) -> None:
    s = load(tmp_path, 'base_url = "http://127.0.0.1:8000/v1"\n')
    assert ModelRouter.from_settings(s).upstreams[0].replicas is None


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('base_url = "http://a:1/v1"\nreplicas = ["http://b:1/v1"]', "give base_url (one server) or"),
        ('models = ["x"]\n', "give base_url (e.g. http://127.0.0.1:8000/v1) or replicas"),
        ('replicas = ["dns://vllm:8000/v1", "http://b:1/v1"]\n', "give it alone"),
        ('replicas = ["dns+https://vllm:8000/v1"]\n', "for https, list the replicas' https:// URLs"),
        ('replicas = ["dns://vllm/v1"]\n', "dns://NAME:PORT/PATH"),
        ('replicas = ["http://b:1/v1", "http://b:1/v1/"]\n', "listed twice"),
        ('replicas = ["ftp://b/v1"]\n', "must be an http:// or https:// URL"),
        ('replicas = ["http://b:1/v1"]\nbalance = "random"\n', "least_request"),
        ('replicas = ["http://b:1/v1"]\nbalance_load_factor = 0\n', "balance_load_factor"),
        ('replicas = ["http://b:1/v1"]\nsession_header = "x y"\n', "is not a header name"),
    ],
)
def test_mistakes_are_named_with_what_to_do(tmp_path: Path, body: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, body)
    assert says in str(err.value)


def test_replica_credentials_are_never_shown() -> None:
    s = Settings(upstreams=[UpstreamSettings(name="p", replicas=["http://u:secret@h:1/v1?key=k"])])
    shown = public_config(s)["upstreams"][0]
    assert shown["replicas"] == ["http://h:1/v1"] and "secret" not in str(shown)
