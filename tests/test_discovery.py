"""dns:// pools: replicas join and leave as the name resolves, a replica that leaves drains, a
failed resolution keeps the last known set and is said once. The resolver is injected (no real
DNS) except in the end-to-end test, which resolves `localhost`."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from proxy.control.discovery import Discovery
from proxy.control.reload import carry_state
from proxy.core.hooks import Observer, ObserverSet
from proxy.core.model_routing import ModelRouter
from proxy.core.replicas import ReplicaPool
from proxy.settings import Settings, UpstreamSettings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, TEST_HEADERS, run_proxy


class Health(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool]] = []

    def replica_health(self, upstream: str, replica: str, up: bool) -> None:
        self.events.append((upstream, replica, up))


class FakeDns:
    def __init__(self, *addresses: str) -> None:
        self.answer: list[str] | Exception = list(addresses)
        self.calls = 0

    async def __call__(self, name: str, port: int) -> list[str]:
        assert (name, port) == ("vllm.llm.svc", 8000)
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


def dns_settings(**extra: object) -> Settings:
    up = UpstreamSettings(name="qwen", replicas=["dns://vllm.llm.svc:8000/v1"], **extra)  # type: ignore[arg-type]
    return Settings(upstreams=[up])


def urls(pool: ReplicaPool) -> list[str]:
    return [r.url for r in pool.members]


def test_replicas_join_leave_and_drain(caplog: pytest.LogCaptureFixture) -> None:
    routing = ModelRouter.from_settings(dns_settings())
    pool = routing.upstreams[0].replicas
    assert pool is not None and pool.members == []
    dns, health = FakeDns("10.0.0.2", "10.0.0.1"), Health()
    discovery = Discovery(lambda: routing, ObserverSet([health]), dns)
    asyncio.run(discovery.resolve_due(0.0))
    assert urls(pool) == ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
    asyncio.run(discovery.resolve_due(4.9))
    assert dns.calls == 1  # not due before discovery_interval_seconds (5)

    busy = pool.members[0]
    pool.begin(busy)
    dns.answer = ["10.0.0.2", "10.0.0.3"]
    asyncio.run(discovery.resolve_due(5.0))
    assert urls(pool) == ["http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1"]
    assert busy.draining and pool.draining == [busy]
    for _ in range(20):
        chosen, _ = pool.choose(None)
        assert chosen is not None and chosen is not busy  # no new request for a replica that left
    pool.end(busy)
    assert pool.draining == []  # its last request ended: forgotten
    assert ("qwen", "http://10.0.0.1:8000/v1", False) in health.events
    assert ("qwen", "http://10.0.0.3:8000/v1", True) in health.events

    # A failed resolution keeps the set, and is said once, however many intervals it lasts.
    caplog.set_level(logging.INFO, logger="infertap.discovery")
    dns.answer = OSError("Name or service not known")
    for t in (10.0, 15.0, 20.0):
        asyncio.run(discovery.resolve_due(t))
    assert urls(pool) == ["http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1"]
    said = [r.getMessage() for r in caplog.records if "does not resolve" in r.getMessage()]
    assert len(said) == 1 and "keeping its 2 known replica(s)" in said[0]
    assert not any(r.exc_info for r in caplog.records)
    dns.answer = ["10.0.0.3"]
    asyncio.run(discovery.resolve_due(25.0))
    assert urls(pool) == ["http://10.0.0.3:8000/v1"]
    assert any("resolves again" in r.getMessage() for r in caplog.records)


def test_a_reload_keeps_the_discovered_replicas_and_their_state() -> None:
    old = ModelRouter.from_settings(dns_settings())
    dns = FakeDns("10.0.0.1", "10.0.0.2")
    asyncio.run(Discovery(lambda: old, ObserverSet(), dns).resolve_due(0.0))
    old_pool = old.upstreams[0].replicas
    assert old_pool is not None
    kept = old_pool.members[0]
    old_pool.begin(kept)
    new = ModelRouter.from_settings(dns_settings(balance="round_robin"))
    carry_state(old, new, False, set())
    new_pool = new.upstreams[0].replicas
    assert new_pool is not None and new_pool.members[0] is kept and kept.in_flight == 1
    # A request that began before the reload chooses among the new pool's members.
    dns.answer = ["10.0.0.2"]
    asyncio.run(Discovery(lambda: new, ObserverSet(), dns).resolve_due(0.0))
    assert kept.draining and old_pool.choose(None)[0] is new_pool.members[0]
    old_pool.end(kept)
    assert kept.in_flight == 0 and not new_pool.draining


def test_a_dns_pool_end_to_end(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    port = url.split(":")[2].split("/")[0]
    up = UpstreamSettings(name="local", replicas=[f"dns://localhost:{port}/v1"], forward_headers=TEST_HEADERS)
    with run_proxy(Settings(upstreams=[up])) as proxy:
        # localhost may resolve to ::1 too, where nothing listens: a refused attempt goes to 127.0.0.1.
        r = httpx.post(f"{proxy}/v1/chat/completions", json=CHAT, timeout=30)
        rows = httpx.get(f"{proxy}/status", timeout=10).json()["upstreams"][0]["replicas"]
        models = httpx.get(f"{proxy}/v1/models", timeout=10)  # asks a replica of the pool
    assert models.status_code == 200 and models.json()["data"], models.text
    assert r.status_code == 200
    assert [q.path for q in upstream.requests] == ["/v1/chat/completions", "/v1/models"]
    assert f"http://127.0.0.1:{port}/v1" in [row["address"] for row in rows]
