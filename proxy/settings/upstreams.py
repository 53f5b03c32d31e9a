"""An upstream's settings: where it is, which models it serves, its key's variable, its overrides."""

from __future__ import annotations

import os
import re
from typing import Self
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.settings.sections import TAOTOKEN_HOST, RetrySettings, TimeoutSettings, _Section

# RFC 9110 token characters, and an optional trailing `*` for a prefix.
_HEADER_PATTERN = re.compile(r"[a-z0-9!#$%&'+.^_`|~-]*[a-z0-9!#$%&'+.^_`|~-]\*?|\*")
_CREDENTIALS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "api-key",
        "x-api-key",
        "cookie",
        "set-cookie",
        "www-authenticate",
    }
)


class UpstreamSettings(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    base_url: str = Field(description="the OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    api_key_env: str | None = Field(default=None, description="NAME of the env variable holding the key")
    models: list[str] = Field(default_factory=list, description="glob patterns routed here; first match wins")
    default: bool = False
    headers: dict[str, str] = Field(default_factory=dict)
    fallback: list[str] = Field(
        default_factory=list, description="upstreams to try, in order, when this one's attempts fail"
    )
    forward_headers: list[str] = Field(
        default_factory=list,
        description="client headers to forward beyond the default allow-list (names, or `prefix-*`), "
        "e.g. openai-organization; credentials and hop-by-hop headers never pass",
    )
    return_headers: list[str] = Field(
        default_factory=list,
        description="answer headers to return to clients beyond the default allow-list (names, or "
        "`prefix-*`); credentials and cookies never pass",
    )
    timeouts: dict[str, float | None] = Field(default_factory=dict, description="overrides [timeouts]")
    retry: dict[str, float] = Field(default_factory=dict, description="overrides [retry]")
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="requests in flight to this upstream at most (its own connection pool; default "
        "1000); more wait up to [timeouts] pool, then fail with pool_timeout",
    )

    # Each override is checked here, with the rest of the file, by the section's own model: the
    # same bounds as [timeouts] and [retry], and an error that names the field
    # (upstreams.0.timeouts.ttft), rather than when the server builds its routing.
    @field_validator("timeouts")
    @classmethod
    def _known_timeouts(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        unknown = set(v) - set(TimeoutSettings.model_fields) - {"read"}
        if unknown:
            raise ValueError(
                f"unknown timeout(s) {sorted(unknown)}; known: {sorted(TimeoutSettings.model_fields)}"
            )
        if "read" in v and "idle" in v:
            raise ValueError("give idle or read (its other name), not both")
        TimeoutSettings.model_validate(v)
        return v

    @field_validator("retry")
    @classmethod
    def _known_retry(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = set(v) - set(RetrySettings.model_fields)
        if unknown:
            raise ValueError(
                f"unknown retry setting(s) {sorted(unknown)}; known: {sorted(RetrySettings.model_fields)}"
            )
        RetrySettings.model_validate(v)
        return v

    def effective_timeouts(self, base: TimeoutSettings) -> TimeoutSettings:
        overrides = {("idle" if k == "read" else k): v for k, v in self.timeouts.items()}
        return TimeoutSettings.model_validate({**base.model_dump(), **overrides})

    def effective_retry(self, base: RetrySettings) -> RetrySettings:
        return RetrySettings.model_validate({**base.model_dump(), **self.retry})

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
        return v.rstrip("/")

    @field_validator("headers")
    @classmethod
    def _no_credentials(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if name.lower() in ("authorization", "api-key", "x-api-key"):
                raise ValueError(f"header {name!r} carries a credential: use api_key_env instead")
        return v

    @field_validator("forward_headers", "return_headers")
    @classmethod
    def _header_patterns(cls, v: list[str]) -> list[str]:
        out = []
        for p in v:
            name = p.strip().lower()
            if not _HEADER_PATTERN.fullmatch(name):
                raise ValueError(f"{p!r} is not a header name (or a `prefix-*` pattern)")
            if name in _CREDENTIALS:
                raise ValueError(f"{p!r} carries a credential: it never crosses infertap")
            out.append(name)
        return out

    @model_validator(mode="after")
    def _one_credential(self) -> Self:
        # Both would be sent, and the HTTP client refuses to combine them: every request a 500.
        if self.api_key_env and urlsplit(self.base_url).username is not None:
            raise ValueError(
                "base_url carries credentials (user:password@) and api_key_env is set: use one of them"
            )
        return self

    @model_validator(mode="after")
    def _taotoken_key(self) -> Self:
        # TaoToken's one documented key variable, so `--upstream https://taotoken.net/api` just works.
        if self.api_key_env is None and urlsplit(self.base_url).hostname == TAOTOKEN_HOST:
            self.api_key_env = "TAOTOKEN_API_KEY"
        return self

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        return os.environ.get(self.api_key_env) or None
