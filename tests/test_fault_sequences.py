"""The randomized, stateful fault-sequence test (docs/resilience.md, "Fault sequences").

hypothesis draws sequences of steps: requests (chat, completions, responses; streaming or not; each
with an upstream fault and a client that may leave early), run a few at a time, and upstreams that
break for a while and heal. Every example runs a real infertap over real sockets on 127.0.0.1 in
front of two scripted upstreams and one that refuses connections, with retries, fallback, the
circuit breaker and every timeout on, with short values. After each example every invariant of
issue 13 is checked; a failure shrinks to a minimal sequence, which becomes a regression test.

CI runs INFERTAP_FAULT_EXAMPLES (default 40) examples, shared between the upstream clients (each
implementation of the seam runs half); a long run sets it to thousands (each client runs that
many over two; `-k httptools` runs only one).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from proxy.app import InfertapApp, create_app
from proxy.core.asgi import Receive, Scope, Send
from proxy.core.exchange import Exchange
from proxy.core.hooks import Observer
from proxy.settings import Settings, UpstreamSettings
from proxy.tools.fake_upstream import FakeUpstream
from proxy.transport import CLIENTS
from tests.conftest import TEST_HEADERS, RecordingObserver, serve_in_thread, wait_until
from tests.promtext import samples, scrape, value

SECRET = "sk-fault-sequence-secret-4242"
KEY_ENV = "INFERTAP_TEST_FAULT_KEY"
EXAMPLES = int(os.environ.get("INFERTAP_FAULT_EXAMPLES", "40"))
DEAD = "http://127.0.0.1:9/v1"
KEEP_ALIVE = b": keep-alive\n\n"
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
MODELS = {"a": "a-model", "b": "b-model", "d": "d-model"}  # d: refused connections, falls back to a
ESCAPES = ["/v1/..%2F..%2Fsecret", "/v1/%2E%2E/%2E%2E/secret", "/v1/files/..%2F..%2F..%2Fadmin"]
FAULTS: dict[str, dict[str, str]] = {
    "ok": {},
    "json": {},  # with stream false: a whole JSON answer
    "hang": {"x-fake-hang": "before-headers"},
    "stall_before_token": {"x-fake-hang": "after-role"},
    "stall_after_token": {"x-fake-hang": "after-first"},
    "429": {"x-fake-fail-first": "1", "x-fake-fail-status": "429", "x-fake-retry-after": "0"},
    "503_once": {"x-fake-fail-first": "1"},
    "500": {"x-fake-status": "500"},
    "cut": {"x-fake-cut": "2"},
    "malformed": {"x-fake-malformed": "1"},
    "no_done": {"x-fake-no-done": "1"},
    "trickle": {"x-fake-gap-ms": "30", "x-fake-events": "8"},
    "reject_stream_options": {"x-fake-reject-stream-options": "1"},
}


class Breakable:
    """A scripted upstream that can be broken (503 to everything) and healed, and that records
    every request's id as it arrives, whichever way it is answered."""

    def __init__(self) -> None:
        self.fake = FakeUpstream()
        self.broken = False
        self.seen: list[str] = []
        self.paths: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            agent = dict(scope["headers"]).get(b"user-agent", b"")
            if not agent.endswith(b"upstream-check"):
                self.seen.append(dict(scope["headers"]).get(b"x-request-id", b"").decode())
                self.paths.append(scope.get("raw_path") or scope["path"].encode())
            if self.broken:
                body = b'{"error": {"message": "broken for a while", "type": "fake"}}'
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": body})
                return
        await self.fake(scope, receive, send)

    def reset(self) -> None:
        self.fake.__init__()  # type: ignore[misc]
        self.broken = False
        self.seen.clear()
        self.paths.clear()


class Attempts(Observer):
    """Attempts per (request, upstream), and TTFB observations per attempt."""

    name = "attempts"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.per: Counter[tuple[str, str]] = Counter()
        self.ttfb_per_attempt: dict[str, list[int]] = {}
        self.reprs: list[str] = []

    def attempt_started(self, ex: Exchange) -> None:
        with self.lock:
            self.per[(ex.request_id, ex.upstream or "")] += 1
            self.ttfb_per_attempt.setdefault(ex.request_id, []).append(0)

    def first_byte(self, ex: Exchange) -> None:
        with self.lock:
            self.ttfb_per_attempt.setdefault(ex.request_id, [0])[-1] += 1

    def ended(self, ex: Exchange) -> None:
        with self.lock:
            self.reprs.append(repr(ex))


@dataclass
class Req:
    route: str
    model: str
    stream: bool
    usage: bool
    fault: str
    leave: str  # never | early | after_first
    escape: int | None = None


@dataclass
class Outcome:
    rid: str
    req: Req
    status: int | None = None
    body: bytes = b""
    headers: str = ""
    aborted: bool = False
    left: bool = False


@dataclass
class World:
    a: Breakable
    b: Breakable
    a_url: str
    b_url: str


class _Capture(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(f"{record.name} {record.getMessage()}")


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    a, b = Breakable(), Breakable()
    os.environ[KEY_ENV] = SECRET
    try:
        with serve_in_thread(a) as ua, serve_in_thread(b) as ub:
            yield World(a, b, ua + "/v1", ub + "/v1")
    finally:
        os.environ.pop(KEY_ENV, None)


def _settings(w: World, stream_headers: str = "first_token", client: str = "httptools") -> Settings:
    ups = [
        UpstreamSettings(
            name="a",
            base_url=w.a_url,
            models=["a-*"],
            fallback=["b"],
            api_key_env=KEY_ENV,
            forward_headers=TEST_HEADERS,
        ),
        UpstreamSettings(
            name="b", base_url=w.b_url, models=["b-*"], api_key_env=KEY_ENV, forward_headers=TEST_HEADERS
        ),
        UpstreamSettings(
            name="d", base_url=DEAD, models=["d-*"], fallback=["a"], forward_headers=TEST_HEADERS
        ),
    ]
    return Settings.model_validate(
        {
            "upstreams": [u.model_dump() for u in ups],
            "retry": {"max_attempts": 2, "backoff_seconds": 0.01, "max_backoff_seconds": 0.05},
            "timeouts": {"connect": 1, "ttft": 0.4, "idle": 0.4, "total": 3.0},
            "circuit": {"failure_rate": 0.5, "min_calls": 4, "window_seconds": 5, "cooldown_seconds": 0.5},
            "server": {
                "upstream_check_interval": 60,
                "stream_headers": stream_headers,
                "stream_keep_alive_seconds": 0.02,  # well below ttft and the trickle's gaps
                "upstream_client": client,
            },
        }
    )


def _send(proxy: str, rid: str, r: Req) -> Outcome:
    out = Outcome(rid, r)
    headers = {"x-request-id": rid, **FAULTS[r.fault]}
    body: dict[str, Any] = {"model": MODELS[r.model], "stream": r.stream}
    body["messages" if r.route == "chat" else ("prompt" if r.route == "completions" else "input")] = (
        [{"role": "user", "content": "hi"}] if r.route == "chat" else "hi"
    )
    if r.stream and r.usage and r.route != "responses":
        body["stream_options"] = {"include_usage": True}
    path = ESCAPES[r.escape] if r.escape is not None else ROUTES[r.route]
    timeout = httpx.Timeout(10, read=0.05) if r.leave == "early" else httpx.Timeout(10)
    buf = bytearray()
    try:
        with (
            httpx.Client(timeout=timeout) as c,
            c.stream("POST", proxy + path, json=body, headers=headers) as resp,
        ):
            out.status = resp.status_code
            out.headers = json.dumps(dict(resp.headers))
            for chunk in resp.iter_raw():
                buf.extend(chunk)
                if r.leave == "after_first":
                    out.left = True
                    break
    except httpx.TimeoutException:
        out.left = True
    except httpx.HTTPError:
        out.aborted = True
    out.body = bytes(buf)
    return out


def _strip_usage(raw: bytes) -> bytes:
    """The upstream's stream as the client's own request would have had it: without the usage-only
    chunk and the `"usage":null` of every other chunk (infertap asked for usage, the client did not)."""
    kept = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"choices":[]' in event and b'"usage":{' in event:
            continue
        kept.append(event.replace(b',"usage":null', b""))
    return b"\n\n".join(kept)


def _without_keep_alive(body: bytes) -> bytes:
    """The body without the keep-alive comments of stream_headers = "immediately": they come only
    before the first upstream byte (a comment anywhere else fails the byte comparison)."""
    while body.startswith(KEEP_ALIVE):
        body = body[len(KEEP_ALIVE) :]
    return body


def _check_answer(o: Outcome, rec: RecordingObserver, w: World) -> None:
    """Byte-identical to what the answering upstream sent, or a visible failure."""
    if o.left or o.aborted:
        return  # the client left, or saw the connection abort: visible
    assert o.status is not None
    if o.req.escape is not None:
        assert o.status == 400, o
        return
    if o.status != 200:
        assert b'"error"' in o.body, o  # an error status with an OpenAI-style error body
        return
    if not o.req.stream:
        assert "error" not in json.loads(o.body), o  # a whole JSON answer: it parses (a cut one would not)
        return
    body = _without_keep_alive(o.body)
    events = [e for e in body.split(b"\n\n") if e]
    last = events[-1] if events else b""
    if b'"error"' in last and last.startswith((b"data: {", b"event: response.failed\n")):
        return  # an in-band error event (the Responses API's ends with response.failed): visible
    ex = rec.exchanges[o.rid]
    sent = {"a": w.a.fake.sent, "b": w.b.fake.sent}[ex.upstream or ""].get(o.rid, bytearray())
    expected = bytes(sent)
    if not (o.req.usage and o.req.route != "responses"):
        expected = _strip_usage(expected)
    assert body == expected, f"a 200 answer that is not the upstream's and carries no error: {o}"


def _run_example(
    w: World, steps: list[Any], stream_headers: str = "first_token", client: str = "httptools"
) -> None:
    w.a.reset()
    w.b.reset()
    rec, attempts = RecordingObserver(), Attempts()
    logs: list[str] = []
    handler = _Capture(logs)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    app: InfertapApp = create_app(_settings(w, stream_headers, client), [rec, attempts])
    outcomes: list[Outcome] = []
    try:
        with serve_in_thread(app) as proxy, concurrent.futures.ThreadPoolExecutor(4) as pool:
            n = 0
            batch: list[tuple[str, Req]] = []

            def flush() -> None:
                outcomes.extend(pool.map(lambda item: _send(proxy, *item), batch))
                batch.clear()

            for step in steps:
                if isinstance(step, Req):
                    n += 1
                    batch.append((f"r{n}", step))
                    if len(batch) == 4:
                        flush()
                else:
                    flush()
                    action, name = step
                    getattr(w, name).broken = action == "break"
            flush()
            sent = [o.rid for o in outcomes]
            for rid in sent:
                wait_until(lambda rid=rid: rec.terminal_count(rid) >= 1, 15, f"the terminal hook of {rid}")  # type: ignore[misc]
            # Healing: every upstream is back in service within its cool-down plus one probe.
            w.a.broken = w.b.broken = False
            for name in ("a", "b"):
                up = next((u for u in app.routing.upstreams if u.name == name), None)
                assert up is not None
                wait_until(lambda up=up: up.breaker.state(time.monotonic()) != "open", 5, f"{name} cool-down")  # type: ignore[misc]
                probe = _send(proxy, f"heal-{name}", Req("chat", name, False, False, "ok", "never"))
                assert probe.status == 200, probe
            sent += ["heal-a", "heal-b"]
            text = scrape(proxy)
            for name in ("a", "b"):
                assert value(text, "infertap_upstream_up", upstream=name) == 1, f"{name} did not come back"
            assert value(text, "infertap_in_flight_requests") == 0
            status_body = httpx.get(proxy + "/status").text
            models_body = httpx.get(proxy + "/v1/models").text
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)

    # Exactly one terminal hook per request (and none for a request never sent).
    for rid in sent:
        assert rec.terminal_count(rid) == 1, (rid, rec.hooks_for(rid))
        assert rec.hooks_for(rid)[0] == "request_received", rid
        # A retry counted is a retry made: every `retry` hook is followed by another attempt
        # (a failure that opened the last circuit left must neither wait nor count one).
        # (Unless the request's own deadline or its client ended it during the backoff.)
        hooks = rec.hooks_for(rid)
        cut = str(rec.exchanges[rid].outcome) in ("total_timeout", "client_disconnect")
        for at, hook in enumerate(hooks):
            if hook == "retry" and not cut:
                assert "attempt_started" in hooks[at + 1 :], (rid, rec.exchanges[rid].outcome, hooks)
    # Each answer: the upstream's bytes, or a visible failure.
    for o in outcomes:
        _check_answer(o, rec, w)
    # Per outcome: the metric, the access log and the terminal hooks agree.
    by_metric: Counter[str] = Counter()
    for name, labels, v in samples(text):
        if name == "infertap_requests_total" and v:
            by_metric[labels["outcome"]] += int(v)
    access = [
        json.loads(line.removeprefix("infertap.access "))
        for line in logs
        if line.startswith("infertap.access ")
    ]
    # The /status and /v1/models calls above have lines of their own, with no outcome (infertap
    # answered them itself); the scrapes' lines are DEBUG.
    assert sorted(a["route"] for a in access if a["outcome"] is None) == ["models", "status"]
    by_log = Counter(a["outcome"] for a in access if a["outcome"] is not None)
    by_hooks = Counter(str(rec.exchanges[rid].outcome) for rid in sent)
    assert by_metric == by_hooks == by_log, (by_metric, by_hooks, by_log)
    # Attempts counted equal the attempts the upstreams saw; TTFB at most once per attempt.
    seen: Counter[tuple[str, str]] = Counter()
    for up_name, up in (("a", w.a), ("b", w.b)):
        seen.update((rid, up_name) for rid in up.seen if rid in rec.exchanges)
    for (rid, up_name), count in attempts.per.items():
        if up_name == "d":
            continue
        if rec.exchanges[rid].outcome in ("client_disconnect", "total_timeout"):
            assert seen[(rid, up_name)] <= count, (rid, up_name)
        else:
            assert seen[(rid, up_name)] == count, (rid, up_name, seen[(rid, up_name)], count)
    assert sum(seen.values()) <= sum(c for (_, u), c in attempts.per.items() if u != "d")
    for rid, per in attempts.ttfb_per_attempt.items():
        assert all(n <= 1 for n in per), (rid, per)
    # No path outside the base path reached an upstream.
    for p in w.a.paths + w.b.paths:
        assert p.startswith(b"/v1/") and b".." not in p and b"%2e" not in p.lower(), p
    # No key anywhere but the upstream's Authorization header.
    everywhere = "\n".join(
        [*logs, text, status_body, models_body, *attempts.reprs]
        + [o.body.decode("latin-1") + o.headers for o in outcomes]
        + [repr(ex) for ex in rec.exchanges.values()]
    )
    assert SECRET not in everywhere


def _req() -> st.SearchStrategy[Req]:
    return st.builds(
        Req,
        route=st.sampled_from(list(ROUTES)),
        model=st.sampled_from(["a", "a", "b", "d"]),
        stream=st.booleans(),
        usage=st.booleans(),
        fault=st.sampled_from(list(FAULTS)),
        leave=st.sampled_from(["never", "never", "never", "early", "after_first"]),
        escape=st.one_of(st.none(), st.none(), st.none(), st.none(), st.sampled_from(range(len(ESCAPES)))),
    )


STEPS = st.lists(
    st.one_of(
        _req(), _req(), _req(), st.tuples(st.sampled_from(["break", "heal"]), st.sampled_from(["a", "b"]))
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=max(1, EXAMPLES // len(CLIENTS)),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
    print_blob=True,
    # No "explain" phase: it reruns the failing example dozens of times, minutes on a loaded machine.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
@given(steps=STEPS, stream_headers=st.sampled_from(["first_token", "immediately"]))
# Shrunk sequences that found bugs, kept as regression tests (each runs in every CI run).
@example(  # a success that brought the calls to min_calls opened the circuit (proxy/core/circuit.py)
    steps=[Req("chat", "a", False, False, "ok", "never"), Req("chat", "a", False, False, "hang", "never")],
    stream_headers="first_token",
)
@pytest.mark.timeout(0)
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_fault_sequences_keep_every_invariant(
    world: World, client: str, steps: list[Any], stream_headers: str
) -> None:
    _run_example(world, steps, stream_headers, client)
