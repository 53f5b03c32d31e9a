"""An upstream's error answer reaches the client in OpenAI's shape, so every SDK shows its message
(issue 23, item 6: vLLM's `{"object": "error", "message": ...}` reached the JavaScript clients as
"400 status code (no body)", and a load balancer's plain 502 page as nothing at all).

Only error statuses, and only bodies not already OpenAI-shaped, are rewritten; the engine's fields
are kept inside `error`, and the Content-Length is the new body's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from proxy.core.error_bodies import EXCERPT_CHARS, MAX_ERROR_BODY, openai_error_body
from proxy.settings import UpstreamSettings
from tests.conftest import CHAT, TEST_HEADERS, make_settings, run_proxy
from tests.raw_upstream import chunked, raw_upstream, whole

TOO_LONG = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
VLLM = {"object": "error", "message": TOO_LONG, "type": "BadRequestError", "param": None, "code": 400}
SGLANG_MESSAGE = "The input (5000 tokens) is longer than the model's context length (4096 tokens)."
SGLANG = {"object": "error", "message": SGLANG_MESSAGE, "type": "BadRequestError", "param": None, "code": 400}
NGINX = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx/1.25.3</center>\r\n"
    b"</body>\r\n</html>\r\n"
)
OPENAI_SHAPED = {
    "error": {
        "message": "Invalid 'temperature'",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }
}
KEY = "sk-upstream-0123456789abcdef"
VLLM_502 = "upstream 'vllm' answered HTTP 502"

# x-test-shape: (status line, content type, body)
SHAPES: dict[str, tuple[str, str, bytes]] = {
    "vllm": ("400 Bad Request", "application/json", json.dumps(VLLM).encode()),
    "sglang": ("400 Bad Request", "application/json", json.dumps(SGLANG).encode()),
    "text": ("502 Bad Gateway", "text/plain", b"upstream connect error or disconnect/reset before headers\n"),
    "html": ("502 Bad Gateway", "text/html", NGINX),
    "empty": ("503 Service Unavailable", "text/plain", b""),
    "openai": ("400 Bad Request", "application/json", json.dumps(OPENAI_SHAPED).encode()),
    "echoes-key": ("401 Unauthorized", "text/plain", f"invalid key {KEY}".encode()),
    "huge": ("500 Internal Server Error", "text/html", b"<p>" + b"x" * (MAX_ERROR_BODY + 10) + b"</p>"),
    "ok-text": ("200 OK", "text/plain", b"plain text that is no error"),
}


def _answer(path: str, headers: dict[str, str]) -> bytes:
    status, content_type, body = SHAPES.get(headers.get("x-test-shape", ""), SHAPES["openai"])
    if headers.get("x-test-chunked") == "1":
        return chunked(status, content_type, body, piece=7)
    return whole(status, content_type, body)


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    mp = pytest.MonkeyPatch()
    mp.setenv("INFERTAP_TEST_UPSTREAM_KEY", KEY)
    with raw_upstream(_answer) as url:
        settings = make_settings()
        settings.upstreams = [
            UpstreamSettings(
                name="vllm",
                base_url=url,
                api_key_env="INFERTAP_TEST_UPSTREAM_KEY",
                forward_headers=TEST_HEADERS,
            )
        ]
        settings.retry.max_attempts = 1
        with run_proxy(settings) as proxy:
            yield proxy
    mp.undo()


def _post(proxy: str, shape: str, **extra: Any) -> httpx.Response:
    headers = {"x-test-shape": shape, **extra.pop("headers", {})}
    return httpx.post(f"{proxy}/v1/chat/completions", json={**CHAT, **extra}, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("vllm", TOO_LONG),
        ("sglang", SGLANG_MESSAGE),
        (
            "text",
            "upstream 'vllm' answered HTTP 502: upstream connect error or disconnect/reset before headers",
        ),
        ("html", f"{VLLM_502}: 502 Bad Gateway"),
        ("empty", "upstream 'vllm' answered HTTP 503 with an empty body"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_sdk_shows_the_engines_message(proxy: str, shape: str, message: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(
            model="m",
            messages=CHAT["messages"],  # type: ignore[arg-type]
            stream=stream,
            extra_headers={"x-test-shape": shape},
        )
    client.close()
    err = raised.value
    status = int(SHAPES[shape][0].split()[0])
    assert err.status_code == status and err.message == f"Error code: {status} - {message}"
    assert isinstance(err.body, dict) and err.body["message"] == message
    # What the JavaScript SDKs read: `error.message` in an OpenAI-shaped body, of the stated length.
    for chunked_body in ("0", "1"):
        r = _post(proxy, shape, stream=stream, headers={"x-test-chunked": chunked_body})
        assert r.status_code == status and "error" in r.json(), r.text
        error = r.json()["error"]
        assert error["message"] == message and {"type", "param", "code"} <= set(error)
        assert r.headers["content-type"] == "application/json"
        assert r.headers.get("content-length") == str(len(r.content))


@pytest.mark.parametrize("shape", ["vllm", "sglang"])
def test_the_engines_fields_are_kept(proxy: str, shape: str) -> None:
    engine = json.loads(SHAPES[shape][2])
    error = _post(proxy, shape).json()["error"]
    assert error == engine  # every field, under `error`
    assert list(error)[:4] == ["message", "type", "param", "code"]


@pytest.mark.parametrize("shape", ["openai", "huge", "ok-text"])
def test_an_openai_shaped_oversized_or_successful_body_passes_unchanged(proxy: str, shape: str) -> None:
    status, content_type, body = SHAPES[shape]
    r = _post(proxy, shape)
    assert r.status_code == int(status.split()[0]) and r.content == body
    assert r.headers["content-type"] == content_type


def test_a_key_the_upstream_echoes_is_masked(proxy: str) -> None:
    r = _post(proxy, "echoes-key")
    assert r.status_code == 401 and KEY not in r.text
    assert r.json()["error"]["message"] == "upstream 'vllm' answered HTTP 401: invalid key [redacted]"


def test_a_passthrough_routes_error_page_is_shaped_too(proxy: str) -> None:
    r = httpx.get(f"{proxy}/v1/files/file-1/content", headers={"x-test-shape": "html"}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["message"].endswith("502 Bad Gateway")
    r = httpx.get(f"{proxy}/v1/files/file-1/content", headers={"x-test-shape": "ok-text"}, timeout=30)
    assert r.status_code == 200 and r.content == SHAPES["ok-text"][2]


# -- the rewrite itself --------------------------------------------------------------------------


def test_other_engines_shapes() -> None:
    tgi = json.dumps(
        {"error": "Input validation error: `inputs` must be non-empty", "error_type": "validation"}
    )
    shaped = json.loads(openai_error_body(422, "application/json", tgi.encode(), "tgi", None) or b"")
    assert shaped["error"]["message"] == "Input validation error: `inputs` must be non-empty"
    assert shaped["error"]["type"] == "validation" and "error" not in shaped["error"]

    fastapi = b'{"detail": "Not Found"}'
    shaped = json.loads(openai_error_body(404, "application/json", fastapi, "x", None) or b"")
    assert shaped["error"]["message"] == "Not Found" and shaped["error"]["detail"] == "Not Found"

    validation = b'{"detail": [{"loc": ["body", "model"], "msg": "field required"}]}'
    shaped = json.loads(openai_error_body(422, "application/json", validation, "x", None) or b"")
    assert "field required" in shaped["error"]["message"]

    other = b'{"status": "overloaded"}'
    shaped = json.loads(openai_error_body(503, "application/json", other, "x", None) or b"")
    assert shaped["error"]["message"] == 'upstream \'x\' answered HTTP 503: {"status": "overloaded"}'
    assert shaped["error"]["status"] == "overloaded" and shaped["error"]["type"] == "upstream_error"


def test_an_excerpt_is_short_single_line_and_free_of_markup() -> None:
    page = (
        b"<html><body><script>alert(1)</script><h1>Oops &amp; \x1b[31mred</h1>"
        + b"y " * 500
        + b"</body></html>"
    )
    shaped = json.loads(openai_error_body(500, "text/html", page, "x", None) or b"")
    message = shaped["error"]["message"]
    prefix = "upstream 'x' answered HTTP 500: "
    assert message.startswith(prefix + "Oops & red y y")
    assert len(message) <= len(prefix) + EXCERPT_CHARS and message.endswith("…")
    assert not any(c in message for c in "<>\n\r\x1b")


def test_only_errors_that_are_not_already_openai_shaped() -> None:
    assert openai_error_body(200, "text/plain", b"fine", "x", None) is None
    assert openai_error_body(302, "text/html", b"<a>moved</a>", "x", None) is None
    assert openai_error_body(400, "application/json", json.dumps(OPENAI_SHAPED).encode(), "x", None) is None
    # An `error` object without a string message is not enough for the SDKs.
    shaped = json.loads(
        openai_error_body(400, "application/json", b'{"error": {"code": 7}}', "x", None) or b""
    )
    assert shaped["error"]["message"].startswith("upstream 'x' answered HTTP 400: ")
