"""deploy/alertmanager/alertmanager.yml in a real Alertmanager: what pages, what opens a ticket, and which
alert mutes which (inhibitions need `equal`, or one dead instance mutes every alert of every job)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, tool, wait_until
from tests.live_stack import alertmanager_binary

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        ({"alertname": "InfertapHighErrorRatio", "severity": "critical", "model": "m"}, "pager"),
        ({"alertname": "InfertapAllProxiesDown", "severity": "critical", "job": "infertap"}, "pager"),
        ({"alertname": "InfertapProxyDown", "severity": "warning", "instance": "a:8080"}, "tickets"),
        ({"alertname": "InfertapClientErrors", "severity": "warning", "job": "infertap"}, "tickets"),
        ({"alertname": "InfertapTTFTRegression", "severity": "warning", "model": "m"}, "tickets"),
    ],
)
def test_routing(labels: dict[str, str], receiver: str) -> None:
    r = subprocess.run(
        [
            tool("amtool"),
            "config",
            "routes",
            "test",
            f"--config.file={CONFIG}",
            *(f"{k}={v}" for k, v in labels.items()),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == receiver


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("am")
    port = free_port()
    with (tmp / "log").open("w") as log:
        proc = subprocess.Popen(
            [
                alertmanager_binary(),
                f"--config.file={CONFIG}",
                f"--storage.path={tmp}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        wait_until(ready, 30, "alertmanager to start")
        assert proc.poll() is None, (tmp / "log").read_text()
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def inhibited(am: str, alerts: list[dict[str, str]]) -> dict[str, list[str]]:
    """Post these alerts (firing) and return, per alert, the fingerprints of what inhibits it."""
    now = datetime.now(UTC)
    body = [
        {"labels": a, "startsAt": now.isoformat(), "endsAt": (now + timedelta(minutes=5)).isoformat()}
        for a in alerts
    ]
    httpx.post(f"{am}/api/v2/alerts", json=body, timeout=10).raise_for_status()

    def key(labels: dict[str, str]) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "severity")

    wanted = {key(a) for a in alerts}

    def listed() -> dict[str, list[str]] | None:
        got = httpx.get(f"{am}/api/v2/alerts", timeout=10).json()
        out = {key(a["labels"]): a["status"]["inhibitedBy"] for a in got if key(a["labels"]) in wanted}
        return out if set(out) == wanted else None

    deadline = time.monotonic() + 20
    while (out := listed()) is None:
        assert time.monotonic() < deadline, "alerts did not show up in Alertmanager"
        time.sleep(0.1)  # polling interval, bounded by the deadline
    return out


def test_one_instance_down_mutes_nothing_all_down_mutes_its_job_only(am: str) -> None:
    one = {"alertname": "InfertapProxyDown", "severity": "warning", "job": "infertap", "instance": "a:8080"}
    no_traffic = {"alertname": "InfertapNoTraffic", "severity": "warning", "job": "infertap", "model": "m"}
    errors = {"alertname": "InfertapHighErrorRatio", "severity": "critical", "job": "infertap", "model": "m"}
    other_job = {
        "alertname": "InfertapNoTraffic",
        "severity": "warning",
        "job": "infertap-batch",
        "model": "m",
    }
    status = inhibited(am, [one, no_traffic, errors, other_job])
    assert all(v == [] for v in status.values()), status  # one dead pod of several: nothing muted

    all_down = {"alertname": "InfertapAllProxiesDown", "severity": "critical", "job": "infertap"}
    status = inhibited(am, [all_down, one, no_traffic, errors, other_job])
    muted = {k.split(",")[0] for k, v in status.items() if v}
    assert muted == {
        "alertname=InfertapHighErrorRatio",
        "alertname=InfertapNoTraffic",
        "alertname=InfertapProxyDown",
    }
    assert not status["alertname=InfertapNoTraffic,job=infertap-batch,model=m"]  # another job: not muted
    assert not status["alertname=InfertapAllProxiesDown,job=infertap"]


def test_upstream_down_mutes_that_upstreams_timeouts_only(am: str) -> None:
    down = {"alertname": "InfertapUpstreamDown", "severity": "critical", "upstream": "a"}
    timeouts_a = {
        "alertname": "InfertapHighTimeoutRate",
        "severity": "warning",
        "upstream": "a",
        "phase": "ttft",
    }
    timeouts_b = {
        "alertname": "InfertapHighTimeoutRate",
        "severity": "warning",
        "upstream": "b",
        "phase": "ttft",
    }
    status = inhibited(am, [down, timeouts_a, timeouts_b])
    assert status["alertname=InfertapHighTimeoutRate,phase=ttft,upstream=a"]
    assert not status["alertname=InfertapHighTimeoutRate,phase=ttft,upstream=b"]
