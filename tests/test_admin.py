"""The operator API and the OpenAPI document: typed answers, the admin token, secrets redacted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from proxy.api.operator import EffectiveConfig, UpstreamState
from proxy.settings import AuthSettings, ServerSettings, Settings, UpstreamSettings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import free_port, make_settings, run_proxy, serve_in_thread

TOKEN = "admin-token-for-tests"
UPSTREAM_KEY = "sk-upstream-secret-value"
HEADER_SECRET = "header-secret-value"


@pytest.fixture
def admin_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("INFERTAP_TEST_ADMIN", TOKEN)
    monkeypatch.setenv("INFERTAP_TEST_UPKEY", UPSTREAM_KEY)
    yield


def _settings(url: str, **extra: Any) -> Settings:
    up = UpstreamSettings(
        name="fake",
        base_url=url,
        api_key_env="INFERTAP_TEST_UPKEY",
        models=["fake-*"],
        headers={"x-tenant-secret": HEADER_SECRET},
    )
    return Settings(upstreams=[up], **extra)


def test_admin_routes_need_their_token(admin_env: None, fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = _settings(url, auth=AuthSettings(admin_token_env="INFERTAP_TEST_ADMIN"))
    with run_proxy(settings) as proxy:
        for path in ("/admin/upstreams", "/admin/config"):
            for given in (None, "Bearer wrong", TOKEN):
                headers = {"authorization": given} if given else {}
                r = httpx.get(proxy + path, headers=headers)
                assert r.status_code == 401, (path, given)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"authorization": f"Bearer {TOKEN}"}
        ups = TypeAdapter(list[UpstreamState]).validate_python(
            httpx.get(proxy + "/admin/upstreams", headers=ok).json()
        )
        assert [(u.name, u.default, u.circuit.state, u.in_flight) for u in ups] == [
            ("fake", True, "closed", 0)
        ]
        # Traffic shows up: requests, recent TTFT p50.
        chat = {"model": "fake-1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert httpx.post(proxy + "/v1/chat/completions", json=chat).status_code == 200
        (up,) = TypeAdapter(list[UpstreamState]).validate_python(
            httpx.get(proxy + "/admin/upstreams", headers=ok).json()
        )
        assert up.requests == 1 and up.ttft_p50_seconds is not None and up.tpot_p50_seconds is not None
        assert up.last_failure is None and up.in_flight == 0
        cfg = EffectiveConfig.model_validate(httpx.get(proxy + "/admin/config", headers=ok).json())
        assert "upstreams" in cfg.reloadable and cfg.reloaded_at is None
        assert cfg.config["upstreams"][0]["api_key_env"] == "INFERTAP_TEST_UPKEY"
        assert cfg.config["auth"]["admin_token_env"] == "INFERTAP_TEST_ADMIN"
        text = httpx.get(proxy + "/admin/config", headers=ok).text
        for secret in (TOKEN, UPSTREAM_KEY, HEADER_SECRET):
            assert secret not in text


def test_without_a_token_setting_the_operator_api_is_off(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        r = httpx.get(proxy + "/admin/upstreams", headers={"authorization": "Bearer anything"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_api_off"
        assert httpx.post(proxy + "/admin/reload").status_code == 403


def test_docs_and_openapi_document_the_operator_api_and_the_proxied_routes(
    fake: tuple[FakeUpstream, str],
) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        docs = httpx.get(proxy + "/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower()
        spec = httpx.get(proxy + "/openapi.json").json()
    paths = spec["paths"]
    assert {"/admin/upstreams", "/admin/config", "/admin/reload", "/healthz", "/readyz", "/v1/models"} <= set(
        paths
    )
    assert "post" in paths["/admin/reload"] and "get" in paths["/admin/upstreams"]
    assert paths["/admin/upstreams"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    chat = paths["/v1/chat/completions"]["post"]
    assert "X-Request-Id" in chat["responses"]["200"]["headers"]
    assert "X-Accel-Buffering" in chat["responses"]["200"]["headers"]
    assert chat["responses"]["502"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert "/v1/{path}" in paths and "/v1/embeddings" in paths
    assert "UpstreamState" in spec["components"]["schemas"]


def test_docs_load_nothing_from_another_host(fake: tuple[FakeUpstream, str]) -> None:
    """Regression (issue 24, item 19): /docs loaded swagger-ui-dist@5 from a CDN, unpinned and
    without integrity checks, and showed nothing in an air-gapped cluster. Every asset the page
    names is infertap's own, and infertap serves it."""
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        page = httpx.get(proxy + "/docs")
        assert page.status_code == 200
        refs = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", page.text)
        assert len(refs) >= 3, refs  # the script, the stylesheet, the icon (and the OpenAPI URL)
        for ref in refs:
            assert ref.startswith("/") and not ref.startswith("//"), f"{ref} is not infertap's own"
            got = httpx.get(proxy + ref)
            assert got.status_code == 200 and got.content, ref
        js = httpx.get(proxy + "/docs/assets/swagger-ui-bundle.js")
        assert "javascript" in js.headers["content-type"] and len(js.content) > 100_000


def test_admin_port_keeps_the_operator_api_off_the_public_port(
    admin_env: None, fake: tuple[FakeUpstream, str]
) -> None:
    _, url = fake
    from proxy.app import create_app

    admin_port = free_port()
    settings = make_settings(
        ("fake", url),
        auth=AuthSettings(admin_token_env="INFERTAP_TEST_ADMIN"),
        server=ServerSettings(admin_port=admin_port),
    )
    ok = {"authorization": f"Bearer {TOKEN}"}
    with serve_in_thread(create_app(settings)) as proxy:
        r = httpx.get(proxy + "/admin/upstreams", headers=ok)
        assert r.status_code == 404 and f"port {admin_port}" in r.json()["error"]["message"]
        assert httpx.get(proxy + "/healthz").status_code == 200


@pytest.mark.parametrize("path", ["/metrics/", "/healthz/", "/readyz//", "/status/", "/openapi.json/"])
def test_a_trailing_slash_is_answered_never_redirected_to_the_clients_host(
    fake: tuple[FakeUpstream, str], path: str
) -> None:
    """Regression (issue 24, item 11): `GET /metrics/` with `Host: evil.example` answered
    `location: http://evil.example/metrics`, the query (`?token=`) kept: a redirect built from what
    the client sent. A trailing slash on an ops route is answered as the route itself."""
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy:
        r = httpx.get(f"{proxy}{path}?token=x", headers={"host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 200, (r.status_code, r.headers)
    assert "location" not in r.headers


_SCHEME = st.lists(st.booleans(), min_size=6, max_size=6).map(
    lambda upper: "".join(c.upper() if u else c for c, u in zip("bearer", upper, strict=True))
)


def test_the_bearer_scheme_is_case_insensitive_for_every_token(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[FakeUpstream, str]
) -> None:
    """RFC 7235: the scheme's name is case-insensitive, and one or more spaces follow it. Regression:
    `bearer KEY` (as some clients and proxies send it) was refused with 401, by the client keys,
    the metrics token and the admin token alike (one parser, auth.bearer_key)."""
    _, url = fake
    monkeypatch.setenv("INFERTAP_TEST_ADMIN", TOKEN)
    monkeypatch.setenv("INFERTAP_TEST_METRICS", "metrics-token")
    monkeypatch.setenv("INFERTAP_TEST_CLIENTS", "client-key")
    auth = AuthSettings(
        keys_env="INFERTAP_TEST_CLIENTS",
        metrics_token_env="INFERTAP_TEST_METRICS",
        admin_token_env="INFERTAP_TEST_ADMIN",
    )
    chat = {"model": "fake-1", "messages": [{"role": "user", "content": "hi"}]}
    with run_proxy(_settings(url, auth=auth)) as proxy, httpx.Client() as c:

        @given(scheme=_SCHEME, spaces=st.integers(1, 3))
        @settings(max_examples=20, deadline=None)
        def every_token(scheme: str, spaces: int) -> None:
            def auth(token: str) -> dict[str, str]:
                return {"authorization": f"{scheme}{' ' * spaces}{token}"}

            assert (
                c.post(f"{proxy}/v1/chat/completions", json=chat, headers=auth("client-key")).status_code
                == 200
            )
            assert c.get(f"{proxy}/metrics", headers=auth("metrics-token")).status_code == 200
            assert c.get(f"{proxy}/admin/config", headers=auth(TOKEN)).status_code == 200
            # ... and still only with the right token, and only that scheme.
            assert c.get(f"{proxy}/admin/config", headers=auth("metrics-token")).status_code == 401
            assert (
                c.get(f"{proxy}/admin/config", headers={"authorization": f"Basic {TOKEN}"}).status_code == 401
            )

        every_token()
