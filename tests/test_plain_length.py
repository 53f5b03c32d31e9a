"""A plain (non-SSE) answer keeps the length its upstream framed it with: Content-Length, the head
and the body in one piece, no chunked framing after them. Before, every plain answer went chunked
(the head and body in one write, then `0\\r\\n\\r\\n` in another): one more send(2) per request, and a
client could not tell the body's length. A chunked answer, or one whose framing is anything but one
plain Content-Length, goes chunked as before."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import make_settings, run_proxy
from tests.raw_upstream import chunked, raw_upstream

BODY = b'{"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 3}}'
REQUEST = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _exchange(proxy: str, method: str = "POST") -> tuple[bytes, bytes]:
    host, port = proxy.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"{method} /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(REQUEST)}\r\nconnection: close\r\n\r\n".encode()
            + REQUEST
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.lower(), body


def _answer(framing: str) -> bytes:
    if framing == "chunked":
        return chunked("200 OK", "application/json", BODY)
    extra = {
        "length": f"content-length: {len(BODY)}\r\n",
        "length-twice": f"content-length: {len(BODY)}\r\ncontent-length: {len(BODY)}\r\n",
    }[framing]
    return (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{extra}connection: close\r\n\r\n".encode()
        + BODY
    )


def test_a_plain_answer_keeps_its_content_length() -> None:
    with (
        raw_upstream(lambda path, headers: _answer("length")) as url,
        run_proxy(make_settings(("raw", url))) as proxy,
    ):
        head, body = _exchange(proxy)
    assert f"content-length: {len(BODY)}".encode() in head.split(b"\r\n")
    assert b"transfer-encoding" not in head
    assert body == BODY


@pytest.mark.parametrize("framing", ["chunked", "length-twice"])
def test_any_other_framing_goes_chunked(framing: str) -> None:
    answer = _answer(framing)
    with raw_upstream(lambda path, headers: answer) as url, run_proxy(make_settings(("raw", url))) as proxy:
        head, body = _exchange(proxy)
    if framing == "length-twice":  # the HTTP client refuses that answer (it is malformed): a 502
        assert head.startswith(b"http/1.1 502")
        return
    assert b"transfer-encoding: chunked" in head.split(b"\r\n")
    assert b"content-length" not in head
    assert _dechunk(body) == BODY


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert data == b"\r\n"
            return out
        out, data = out + data[:n], data[n + 2 :]
