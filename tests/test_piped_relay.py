"""A committed SSE stream relayed in the upstream connection's receive callback (issue 25, item 2;
proxy/core/forward/relay.py `relay_piped`): taken where the upstream client is the httptools one and
the client side is the raw cycle, with the same ends as the task-driven loop and backpressure both
ways; anything else keeps the loop."""

from __future__ import annotations

import socket

import httpx
import orjson
import pytest

from proxy.core.forward import relay
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, wait_until
from tests.test_raw_routes import Answers, proxy, request

KEY = "sk-raw-test"


@pytest.fixture(autouse=True)
def client_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERTAP_TEST_RAW_KEYS", KEY)


def stream(port: int, rid: str, **fake: str) -> str:
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": rid}
    headers.update({"x-fake-" + k.replace("_", "-"): v for k, v in fake.items()})
    with httpx.Client(timeout=10) as client:
        r = client.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
        )
    assert r.status_code == 200
    return r.text


def test_an_sse_stream_is_relayed_in_the_upstream_callback(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    rec = RecordingObserver()
    with proxy(url, (rec,)) as port:
        before = relay.piped_streams
        body = stream(port, "piped", events="50")
        ex = rec.wait_terminal("piped")
    assert relay.piped_streams == before + 1
    assert body.rstrip().endswith("data: [DONE]")
    assert ex.outcome == "ok"
    assert ex.output_events == 50
    assert ex.first_token_at is not None and ex.first_answer_at is not None
    assert ex.completion_tokens is not None
    assert rec.terminal_count("piped") == 1


@pytest.mark.parametrize(
    ("fake_headers", "outcome", "says"),
    [
        ({"no_done": "1"}, "stream_interrupted", "ended the stream without [DONE]"),
        ({"cut": "5"}, "stream_interrupted", "stream_interrupted"),
    ],
)
def test_a_piped_stream_that_breaks_ends_in_band(
    fake: tuple[FakeUpstream, str], fake_headers: dict[str, str], outcome: str, says: str
) -> None:
    _, url = fake
    rec = RecordingObserver()
    with proxy(url, (rec,)) as port:
        before = relay.piped_streams
        body = stream(port, "broken", events="20", **fake_headers)
        ex = rec.wait_terminal("broken")
    assert relay.piped_streams == before + 1
    assert ex.outcome == outcome, (ex.outcome, ex.error_message)
    assert says in body
    assert rec.terminal_count("broken") == 1


def test_a_client_that_never_reads_pauses_the_piped_upstream(fake: tuple[FakeUpstream, str]) -> None:
    """The client's transport pauses the upstream's reading: a bounded part of the stream left the
    upstream (the sockets' buffers, not the proxy's memory), write_timeout aborts the client, and
    the upstream request is cancelled."""
    upstream, url = fake
    rec = RecordingObserver()
    events, size = 5000, 20000
    data = request(
        {**CHAT, "stream": True}, rid=b"never-reads", x_fake_events=str(events), x_fake_event_bytes=str(size)
    )
    with proxy(url, (rec,), write_timeout=1.0) as port, socket.socket() as s:
        before = relay.piped_streams
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.sendall(data)  # and never read the answer
        ex = rec.wait_terminal("never-reads", timeout=30)
        assert ex.outcome == "client_disconnect"
        wait_until(upstream.disconnected.is_set, 10, "the upstream request to be cancelled")
    assert relay.piped_streams == before + 1
    streamed = len(upstream.sent["never-reads"])
    assert 0 < streamed < events * size // 4, streamed


def test_a_slow_reader_gets_the_whole_piped_stream(fake: tuple[FakeUpstream, str]) -> None:
    """Paused and resumed many times over: every byte arrives, in order, and the stream ends well."""
    _, url = fake
    rec = RecordingObserver()
    events, size = 400, 4000
    data = request(
        {**CHAT, "stream": True}, rid=b"slow", x_fake_events=str(events), x_fake_event_bytes=str(size)
    )
    with proxy(url, (rec,)) as port, socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.sendall(data)
        got = b""
        while not got.endswith(b"0\r\n\r\n"):
            chunk = s.recv(1024)  # small reads: the proxy's transport pauses writing again and again
            assert chunk, "the connection closed before the stream's end"
            got += chunk
        ex = rec.wait_terminal("slow")
    assert ex.outcome == "ok"
    assert ex.output_events == events
    answers = Answers()
    answers.parser.feed_data(got)
    body = answers.done[0]["body"]
    chunks = body.split(b"\n\n")
    assert chunks[-2:] == [b"data: [DONE]", b""]
    payloads = [orjson.loads(c.removeprefix(b"data: ")) for c in chunks[:-2]]  # each one whole
    contents = [p["choices"][0]["delta"].get("content") for p in payloads if p["choices"]]
    assert len([c for c in contents if c]) == events


@pytest.mark.parametrize("upstream_client", ["aiohttp"])
def test_other_clients_keep_the_task_driven_loop(
    fake: tuple[FakeUpstream, str], upstream_client: str
) -> None:
    _, url = fake
    settings = make_settings(("fake", url))
    settings.server = settings.server.model_copy(update={"upstream_client": upstream_client})
    rec = RecordingObserver()
    with run_proxy(settings, rec) as base:
        before = relay.piped_streams
        with httpx.Client(timeout=10) as client:
            r = client.post(
                base + "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "loop"}
            )
        ex = rec.wait_terminal("loop")
    assert r.text.rstrip().endswith("data: [DONE]")
    assert ex.outcome == "ok"
    assert relay.piped_streams == before
