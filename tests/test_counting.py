"""Every request that reaches infertap is counted once and logged once (issue 23, item 1).

Forwarded requests are `infertap_requests_total`; every other one (refused before it is read: a
wrong or missing client key, a wrong method, the operator API on the wrong port; and infertap's
own routes: /v1/models, the probes, /metrics, /ui, /docs, unknown paths) is
`infertap_http_requests_total{route, code}` (docs/metrics.md). Each gets one line of the
`infertap.access` logger: probes and scrapes that succeed at DEBUG, everything else at INFO.

The class test draws sequences of requests of every shape, sends them (a few at a time) to a real
infertap with client keys on, and checks that requests counted = requests sent = access-log lines,
that the in-flight gauge returns to 0, and that no key, hash or fragment of one is logged.
CI runs INFERTAP_COUNTING_EXAMPLES (default 12) examples; a long run sets it to hundreds.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from proxy.app import InfertapApp, create_app
from proxy.settings import Settings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, free_port, make_settings, serve_in_thread, wait_until
from tests.promtext import samples, value

KEY = "sk-counting-client-key-5150"
WRONG = "sk-counting-wrong-key-8675309"
KEY_ENV = "INFERTAP_TEST_COUNTING_KEYS"
EXAMPLES = int(os.environ.get("INFERTAP_COUNTING_EXAMPLES", "12"))
MAX_BODY = 4096
GOOD = {"authorization": f"Bearer {KEY}"}
CHAT_PATH = "/v1/chat/completions"


class Lines(logging.Handler):
    """Every log record as `logger LEVEL message`, and the access log's lines parsed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.all: list[str] = []
        self.access: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.all.append(f"{record.name} {record.levelname} {text}")
        if record.name == "infertap.access":
            self.access.append({**json.loads(text), "level": record.levelname})


@contextmanager
def captured() -> Iterator[Lines]:
    """Every infertap log line (the access log's DEBUG ones included) while the block runs."""
    lines = Lines()
    root, access = logging.getLogger(), logging.getLogger("infertap.access")
    old = root.level, access.level
    root.addHandler(lines)
    root.setLevel(logging.INFO)
    access.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        root.removeHandler(lines)
        root.setLevel(old[0])
        access.setLevel(old[1])


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve_in_thread(FakeUpstream()) as url:
        yield url + "/v1"


@pytest.fixture(autouse=True)
def client_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, f"team-a={KEY}")


def _settings(url: str) -> Settings:
    s = make_settings(("fake", url))
    s.auth.keys_env = KEY_ENV
    s.server.max_body_bytes = MAX_BODY
    s.server.admin_port = free_port()  # the operator API lives elsewhere: 404 on the public port
    s.server.upstream_check_interval = 60
    s.retry.max_attempts = 1
    return s


def counted(text: str) -> int:
    return int(value(text, "infertap_requests_total") + value(text, "infertap_http_requests_total"))


def secrets_absent(text: str) -> None:
    """No key, no hash of one, no fragment of one."""
    for key in (KEY, WRONG):
        digest = hashlib.sha256(key.encode()).hexdigest()
        for fragment in (key, key[3:], key[-8:], key[:12], digest[:16], digest[-16:]):
            assert fragment not in text, fragment


def test_refused_and_local_requests_are_counted_and_logged(upstream: str) -> None:
    """Regression: a 401, a 405, an unknown route, the admin API on the wrong port and GET /v1/models
    were counted nowhere and logged nowhere."""
    with captured() as lines, serve_in_thread(create_app(_settings(upstream))) as proxy, httpx.Client() as c:
        assert c.post(proxy + CHAT_PATH, json=CHAT).status_code == 401
        wrong = {"authorization": f"Bearer {WRONG}", "x-request-id": "wrong-key"}
        assert c.post(proxy + CHAT_PATH, json=CHAT, headers=wrong).status_code == 401
        assert c.get(proxy + CHAT_PATH, headers=GOOD).status_code == 405
        assert c.get(proxy + "/v1/models").status_code == 401
        assert c.get(proxy + "/v1/models", headers=GOOD).status_code == 200
        assert c.get(proxy + "/no/such/route").status_code == 404
        assert c.post(proxy + "/healthz").status_code == 405
        assert c.get(proxy + "/admin/upstreams").status_code == 404
        assert c.get(proxy + "/healthz").status_code == 200
        assert c.post(proxy + CHAT_PATH, json=CHAT, headers=GOOD).status_code == 200
        wait_until(lambda: len(lines.access) == 10, what="ten access-log lines")
        text = c.get(proxy + "/metrics").text
    local = {
        (lab["route"], lab["code"]): v
        for n, lab, v in samples(text)
        if n == "infertap_http_requests_total" and v
    }
    assert local == {
        ("chat.completions", "401"): 2,
        ("chat.completions", "405"): 1,
        ("models", "401"): 1,
        ("models", "200"): 1,
        ("unknown", "404"): 1,
        ("healthz", "405"): 1,
        ("admin", "404"): 1,
        ("healthz", "200"): 1,
    }
    assert value(text, "infertap_requests_total") == 1
    by = {(a["route"], a["status"]): a for a in lines.access[:-1]}
    assert len(lines.access) == 11 and len(by) == 9  # the scrape's own line came last
    assert by[("chat.completions", 401)]["level"] == "INFO" and by[("healthz", 200)]["level"] == "DEBUG"
    assert lines.access[1]["request_id"] == "wrong-key" and lines.access[1]["client"] is None
    assert by[("chat.completions", 405)]["client"] == "team-a"  # the key was good, the method not
    assert lines.access[-1]["route"] == "metrics" and lines.access[-1]["level"] == "DEBUG"
    # The forwarded request's line has the same fields as the others.
    assert {k for k in lines.access[0] if k != "level"} == {k for k in lines.access[-2] if k != "level"}
    secrets_absent("\n".join(lines.all) + text)


def test_a_client_that_leaves_during_its_upload_is_counted(upstream: str) -> None:
    """Regression: a client that went away before its body was complete ended with no hook at all:
    not counted, not logged."""
    with captured() as lines, serve_in_thread(create_app(_settings(upstream))) as proxy:
        _abort_upload(proxy, "left-early")
        wait_until(lambda: len(lines.access) == 1, what="the access-log line")
        text = httpx.get(proxy + "/metrics").text
    assert value(text, "infertap_requests_total", outcome="client_disconnect") == 1
    assert value(text, "infertap_in_flight_requests") == 0
    assert lines.access[0]["request_id"] == "left-early" and lines.access[0]["status"] == 499


# -- the class: sequences of requests of every shape ----------------------------------------------


Shape = Callable[[httpx.Client, str, str], None]  # sends one request of a shape under a request id


def _abort_upload(proxy: str, rid: str) -> None:
    """Headers and half a body, then the connection closed."""
    u = urlsplit(proxy)
    with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80)) as s:
        s.sendall(
            f"POST {CHAT_PATH} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"x-request-id: {rid}\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n"
            '{"model": "fake-model", "mess'.encode()
        )


def _abort_stream(c: httpx.Client, proxy: str, rid: str) -> None:
    """A stream left after its first bytes."""
    headers = {**GOOD, "x-request-id": rid, "x-fake-hang": "after-first"}
    with c.stream("POST", proxy + CHAT_PATH, json={**CHAT, "stream": True}, headers=headers) as r:
        for _ in r.iter_raw():
            break


def _post(path: str, **kw: Any) -> Shape:
    def send(c: httpx.Client, proxy: str, rid: str) -> None:
        args = dict(kw)
        c.post(proxy + path, headers={**args.pop("headers", GOOD), "x-request-id": rid}, **args)

    return send


def _req(method: str, path: str, headers: dict[str, str] | None = None) -> Shape:
    def send(c: httpx.Client, proxy: str, rid: str) -> None:
        given = GOOD if headers is None else headers
        c.request(method, proxy + path, headers={**given, "x-request-id": rid})

    return send


SHAPES: dict[str, Shape] = {
    "good": _post(CHAT_PATH, json=CHAT),
    "good_stream": _post(CHAT_PATH, json={**CHAT, "stream": True}),
    "embeddings": _post("/v1/embeddings", json={"model": "fake-model", "input": "hi"}),
    "upstream_500": _post(CHAT_PATH, json=CHAT, headers={**GOOD, "x-fake-status": "500"}),
    "bad_json": _post(CHAT_PATH, content=b'{"model": nope'),
    "no_model": _post(CHAT_PATH, json={"messages": []}),
    "too_large": _post(CHAT_PATH, json={**CHAT, "pad": "x" * MAX_BODY}),
    "no_key": _post(CHAT_PATH, json=CHAT, headers={}),
    "wrong_key": _post(CHAT_PATH, json=CHAT, headers={"authorization": f"Bearer {WRONG}"}),
    "not_bearer": _post(CHAT_PATH, json=CHAT, headers={"authorization": KEY}),
    "wrong_method": _req("GET", CHAT_PATH),
    "wrong_method_no_key": _req("DELETE", "/v1/embeddings", {}),
    "models": _req("GET", "/v1/models"),
    "models_no_key": _req("GET", "/v1/models", {}),
    "passthrough": _req("GET", "/v1/files"),
    "unknown_route": _req("GET", "/no/such/route", {}),
    "unknown_method": _req("POST", "/readyz", {}),
    "admin_elsewhere": _req("GET", "/admin/config", {}),
    "healthz": _req("GET", "/healthz", {}),
    "readyz": _req("GET", "/readyz", {}),
    "metrics": _req("GET", "/metrics", {}),
    "status": _req("GET", "/status", {}),
    "ui": _req("GET", "/ui", {}),
    "openapi": _req("GET", "/openapi.json", {}),
    "abort_upload": lambda c, proxy, rid: _abort_upload(proxy, rid),
    "abort_stream": _abort_stream,
}


BATCH = st.lists(st.sampled_from(sorted(SHAPES)), min_size=1, max_size=4)


def _run(steps: list[list[str]], upstream: str) -> None:
    app: InfertapApp = create_app(_settings(upstream))
    with captured() as lines, serve_in_thread(app) as proxy, concurrent.futures.ThreadPoolExecutor(4) as pool:
        sent = 0
        rids: list[str] = []
        with httpx.Client(timeout=10) as c:
            for batch in steps:  # each batch at once, on its own connections
                jobs = []
                for shape in batch:
                    sent += 1
                    rids.append(f"r{sent}-{shape}")
                    jobs.append(pool.submit(_send_alone, shape, proxy, rids[-1]))
                for job in jobs:
                    job.result()

            def all_counted() -> bool:
                nonlocal sent, text
                # A scrape counts what ended before it, not itself; its own line is already logged.
                text = c.get(proxy + "/metrics").text
                sent += 1
                return counted(text) == sent - 1 and len(lines.access) == sent

            text = ""
            wait_until(all_counted, what=f"{sent} requests counted and logged")
    assert value(text, "infertap_in_flight_requests") == 0
    assert len(lines.access) == sent  # the last scrape's own line included
    # One line per request, each under its own id (the scrapes' ids are infertap's own).
    assert sorted(a["request_id"] for a in lines.access if a["request_id"].startswith("r")) == sorted(rids)
    secrets_absent("\n".join(lines.all) + text)


def _send_alone(shape: str, proxy: str, rid: str) -> None:
    with httpx.Client(timeout=10) as c:
        SHAPES[shape](c, proxy, rid)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
@given(steps=st.lists(BATCH, min_size=1, max_size=5))
@example(steps=[sorted(SHAPES)[i : i + 4] for i in range(0, len(SHAPES), 4)])  # every shape, every run
@pytest.mark.timeout(0)
def test_every_request_is_counted_once_and_logged_once(upstream: str, steps: list[list[str]]) -> None:
    _run(steps, upstream)
