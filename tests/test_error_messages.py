"""Every failure's message says infertap's cause in its own words: which upstream, what it did, where
the request stood and, for a timeout, how long infertap waited; never an HTTP library's class name
(issue 23, item 4: an idle timeout reached clients as "SocketTimeoutError: Timeout on reading data
from socket").

Each ErrorKind that ends a request is provoked through a real upstream on 127.0.0.1 (the scripted
FakeUpstream, a raw server that closes or answers garbage, a listener whose backlog is full), and
the message is read where the client reads it (the JSON error, or the in-band event) and where the
operator does (the request's error in the access log and spans).
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from proxy.core.errors import ERRORS, ErrorKind
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, serve_in_thread
from tests.raw_upstream import raw_upstream

# What an HTTP library's words look like: its name, an exception class, errno, a repr.
LIBRARY_WORDS = re.compile(
    r"aiohttp|asyncio|httpx|h11|uvicorn|\w+(?:Error|Exception)\b|Error:|errno|Traceback|<\w"
    r"|Timeout on reading|ssl:default|Connect call failed|payload|ConnectionKey"
)


@dataclass
class Case:
    kind: ErrorKind  # the request's outcome
    phase: str  # what the message must say of where the request stood
    upstream: Callable[[], AbstractContextManager[str]]  # yields the upstream's base URL
    headers: dict[str, str] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)
    circuit_min_calls: int = 1_000_000
    attempts: int = 1
    status: int = 200  # 200: the failure comes in-band, after commit


@contextmanager
def fake() -> Iterator[str]:
    with serve_in_thread(FakeUpstream()) as url:
        yield url + "/v1"


@contextmanager
def refused() -> Iterator[str]:
    yield "http://127.0.0.1:9/v1"  # the discard port: nothing listens


@contextmanager
def backlog_full() -> Iterator[str]:
    """A listener that never accepts, its backlog filled: the next connection's SYN goes unanswered."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            for s in fillers:
                s.close()


def raw(answer: bytes) -> Callable[[], AbstractContextManager[str]]:
    return lambda: raw_upstream(lambda path, headers: answer)


CASES: dict[str, Case] = {
    "refused": Case(ErrorKind.CONNECT_ERROR, "is unreachable: connection refused", refused, status=502),
    "never accepts": Case(
        ErrorKind.CONNECT_TIMEOUT,
        "did not accept a connection within 0.4 s (connect timeout)",
        backlog_full,
        timeouts={"connect": 0.4},
        status=504,
    ),
    "no headers": Case(
        ErrorKind.TTFT_TIMEOUT,
        "sent nothing for 0.4 s before its response headers (idle timeout)",
        fake,
        {"x-fake-hang": "before-headers"},
        {"idle": 0.4},
        status=504,
    ),
    "silent before the first token": Case(
        ErrorKind.TTFT_TIMEOUT,
        "sent nothing for 0.4 s before the first token (idle timeout)",
        fake,
        {"x-fake-hang": "after-role"},
        {"idle": 0.4},
        status=504,
    ),
    "no token in time": Case(
        ErrorKind.TTFT_TIMEOUT,
        "sent no token within 0.4 s (ttft timeout)",
        fake,
        {"x-fake-hang": "after-role"},
        {"ttft": 0.4},
        status=504,
    ),
    "silent mid-response": Case(
        ErrorKind.IDLE_TIMEOUT,
        "sent nothing for 0.4 s mid-response (idle timeout)",
        fake,
        {"x-fake-hang": "after-first"},
        {"idle": 0.4},
    ),
    "slow before the first token": Case(
        ErrorKind.TOTAL_TIMEOUT,
        "did not finish within 0.4 s before the first token (total timeout)",
        fake,
        {"x-fake-hang": "after-role"},
        {"total": 0.4},
        status=504,
    ),
    "slow mid-response": Case(
        ErrorKind.TOTAL_TIMEOUT,
        "did not finish within 0.4 s mid-response (total timeout)",
        fake,
        {"x-fake-events": "1000", "x-fake-gap-ms": "50"},
        {"total": 0.4},
    ),
    "closes before the headers": Case(
        ErrorKind.STREAM_INTERRUPTED,
        "closed the connection before its response headers",
        raw(b""),
        status=502,
    ),
    "cut before the first token": Case(
        ErrorKind.STREAM_INTERRUPTED,
        "closed the connection before the first token",
        fake,
        {"x-fake-cut": "0"},
        status=502,
    ),
    "cut mid-response": Case(
        ErrorKind.STREAM_INTERRUPTED, "closed the connection mid-response", fake, {"x-fake-cut": "3"}
    ),
    "no [DONE]": Case(
        ErrorKind.STREAM_INTERRUPTED, "ended the stream without [DONE]", fake, {"x-fake-no-done": "1"}
    ),
    "not HTTP": Case(
        ErrorKind.UPSTREAM_5XX,
        "sent malformed HTTP before its response headers",
        raw(b"HELLO WORLD\r\n\r\n"),
        status=502,
    ),
    # A 503 opens the circuit (one call is enough here), so the retry finds no upstream to try:
    # the client gets infertap's account of the last failure.
    "503, circuit opened": Case(
        ErrorKind.UPSTREAM_5XX,
        "answered HTTP 503",
        fake,
        {"x-fake-status": "503"},
        circuit_min_calls=1,
        attempts=2,
        status=503,
    ),
}


def test_every_kind_that_ends_a_request_is_provoked() -> None:
    # A 429's message is always the upstream's own answer (relayed, OpenAI-shaped): infertap never
    # words one, since a 429 does not open the circuit and the last attempt relays it.
    # A full pool needs connections held open meanwhile: its message is checked where that is set
    # up (test_upstream_client.py, test_long_streams_to_one_upstream_never_make_another_wait).
    words_its_own = {kind for kind, info in ERRORS.items() if info.outcome is not None} - {
        ErrorKind.UPSTREAM_429,
        ErrorKind.POOL_TIMEOUT,
    }
    assert {case.kind for case in CASES.values()} == words_its_own


def _message(r: httpx.Response) -> str:
    if r.status_code != 200:
        return str(r.json()["error"]["message"])
    last = json.loads(r.content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
    return str(last["error"]["message"])


@pytest.mark.parametrize("name", list(CASES))
def test_the_message_names_the_upstream_and_the_phase_in_infertaps_words(name: str) -> None:
    case = CASES[name]
    rec = RecordingObserver()
    with case.upstream() as url:
        settings = make_settings(("up", url))
        settings.retry.max_attempts = case.attempts
        settings.retry.backoff_seconds = 0
        settings.circuit.min_calls = case.circuit_min_calls
        for key, value in case.timeouts.items():
            setattr(settings.timeouts, key, value)
        with run_proxy(settings, rec) as proxy:
            body: dict[str, Any] = {**CHAT, "stream": True}
            headers = {**case.headers, "x-request-id": "r"}
            r = httpx.post(f"{proxy}/v1/chat/completions", json=body, headers=headers, timeout=30)
            ex = rec.wait_terminal("r")
    assert (r.status_code, ex.outcome) == (case.status, case.kind.value), r.text
    for said in (_message(r), ex.error_message or ""):
        assert said.startswith(f"upstream 'up' ({url}) "), said
        assert case.phase in said, said
        assert LIBRARY_WORDS.search(said) is None, said


def test_an_exception_no_rule_knows_is_still_said_in_infertaps_words() -> None:
    from proxy.transport.aiohttp_client import _error

    err = _error(RuntimeError("boom from deep inside a library"))
    assert (err.kind, str(err)) == (ErrorKind.UPSTREAM_5XX, "failed in a way infertap does not know")
