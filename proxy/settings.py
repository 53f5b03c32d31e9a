"""Typed settings: defaults < config.toml < INFERTAP_* environment < command-line flags.

Keys never live here: an upstream names the environment variable that holds its key.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from proxy.core.exchange import DEFAULT_PROMPT_CLASS_BOUNDS

TAOTOKEN_BASE_URL = "https://taotoken.net/api"
TAOTOKEN_HOST = "taotoken.net"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    admin_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="serve the operator API (/admin/*) only on this port, at admin_host; none: on port",
    )
    admin_host: str = Field(default="127.0.0.1", description="the address of admin_port")
    workers: int = Field(default=1, ge=1, le=256)
    max_body_bytes: int = Field(default=10 * 1024 * 1024, gt=0, description="larger bodies get 413")
    max_concurrency: int = Field(default=0, ge=0, description="requests at once per worker; 0 = no cap")
    log_level: str = "info"
    drain_timeout: float = Field(
        default=30.0, gt=0, description="after SIGTERM, how long streams in flight may take to finish"
    )
    drain_delay: float = Field(
        default=2.0,
        ge=0,
        description="after SIGTERM, new requests are still served this long (load balancers catch up)",
    )
    ready_needs_upstream: bool = Field(
        default=False, description="/readyz also needs one upstream whose circuit is not open"
    )
    upstream_check_interval: float = Field(
        default=15.0, gt=0, description="seconds between background GET /models checks (GET /status)"
    )
    upstream_check_timeout: float = Field(default=2.0, gt=0, description="each background check's limit")

    @model_validator(mode="after")
    def _drain(self) -> Self:
        if self.drain_delay > self.drain_timeout:
            raise ValueError("drain_delay must not be longer than drain_timeout")
        return self


class TimeoutSettings(_Section):
    """Seconds. Seed client defaults: connect 10 s, read 120 s (`read` is accepted for `idle`)."""

    connect: float = Field(default=10.0, gt=0, description="to open a connection to the upstream")
    ttft: float = Field(default=120.0, gt=0, description="per attempt, until the first output event")
    idle: float = Field(
        default=120.0,
        gt=0,
        validation_alias=AliasChoices("idle", "read"),
        description="longest silence while reading the upstream (also bounds the wait for headers)",
    )
    total: float | None = Field(default=None, gt=0, description="the whole request; none by default")
    pool: float = Field(default=10.0, gt=0, description="longest wait for a free pooled connection")


class RetrySettings(_Section):
    """Seed client defaults: 3 attempts, 2 s backoff."""

    max_attempts: int = Field(default=3, ge=1, le=20)
    backoff_seconds: float = Field(default=2.0, ge=0)
    max_backoff_seconds: float = Field(default=30.0, ge=0)


class CircuitSettings(_Section):
    """An upstream whose attempts fail at `failure_rate` or more over the last `window_seconds`
    (counted once it has seen `min_calls` attempts there) is skipped for `cooldown_seconds`, then
    probed again by one real request. Failures: connection problems, timeouts, 5xx (not 4xx or 429)."""

    failure_rate: float = Field(default=0.5, gt=0, le=1, description="share of failed attempts that opens")
    min_calls: int = Field(default=20, ge=1, description="attempts in the window before the rate counts")
    window_seconds: float = Field(default=30.0, gt=0, description="the sliding window the rate is over")
    cooldown_seconds: float = Field(default=30.0, gt=0, description="open this long, then one probe")
    when_all_open: str = Field(
        default="send",
        pattern=r"^(send|refuse)$",
        description="every candidate's circuit open: send anyway (panic mode) or answer 503",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: Any) -> Any:
        # `failure_threshold`, the consecutive-failure count this replaced, is read as min_calls so
        # that old configs keep working (a re-validated dump may carry both: min_calls wins).
        if isinstance(data, dict) and "failure_threshold" in data:
            data = dict(data)
            data.setdefault("min_calls", data.pop("failure_threshold"))
        return data


class AuthSettings(_Section):
    """Client keys. Never plain keys in this file: an env variable, or a file of SHA-256 hashes."""

    keys_env: str | None = Field(default=None, description="env variable with comma-separated keys")
    keys_file: str | None = Field(default=None, description="file of hex SHA-256 hashes, one a line")
    metrics_token_env: str | None = Field(
        default=None, description="env variable with a bearer token that /metrics and /ui require"
    )
    admin_token_env: str | None = Field(
        default=None,
        description="env variable with the bearer token that the operator API (/admin/*) requires; "
        "unset: the operator API is off",
    )


class MetricsSettings(_Section):
    """Prometheus metrics and the access log. Buckets are in seconds; None keeps the defaults."""

    models: list[str] | None = Field(
        default=None,
        description="glob allow-list for the `model` label (default: the upstreams' model patterns)",
    )
    max_models: int = Field(default=100, ge=1, description="distinct model label values; the rest is 'other'")
    prompt_class_bounds: list[int] = Field(default=list(DEFAULT_PROMPT_CLASS_BOUNDS), min_length=1)
    ttft_buckets: list[float] | None = None
    itl_buckets: list[float] | None = None
    tpot_buckets: list[float] | None = None
    duration_buckets: list[float] | None = None
    exemplars: bool = True
    overhead: bool = Field(
        default=True,
        description="infertap_overhead_seconds and infertap_event_loop_lag_seconds: infertap's own cost",
    )
    access_log: bool = True
    access_log_format: str = Field(default="json", pattern=r"^(json|logfmt)$")

    @field_validator("prompt_class_bounds", "ttft_buckets", "itl_buckets", "tpot_buckets", "duration_buckets")
    @classmethod
    def _increasing(cls, v: list[Any] | None) -> list[Any] | None:
        if v is not None and any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("must be strictly increasing")
        return v


class TracingSettings(_Section):
    """OpenTelemetry export. The standard OTEL_* variables work too and win over these."""

    endpoint: str | None = Field(default=None, description="OTLP endpoint; tracing is off without one")
    protocol: str = Field(default="http/protobuf", pattern=r"^(http/protobuf|grpc)$")
    service_name: str = "infertap"
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    capture_content: bool = Field(default=False, description="record prompts and completions (private!)")
    content_max_chars: int = Field(default=4096, ge=0)


class UISettings(_Section):
    """The built-in page at /ui (docs/ui.md): bounded in-memory rings, one set per worker."""

    enabled: bool = Field(default=True, description="serve /ui and /ui/data; false answers 404")
    window_seconds: int = Field(default=600, ge=10, le=3600, description="the history the charts span")
    step_seconds: int = Field(default=5, ge=1, le=300, description="one chart point (quantiles, rates)")
    recent_requests: int = Field(default=100, ge=1, le=10_000, description="rows in the last-requests table")
    samples_per_step: int = Field(
        default=200, ge=10, le=10_000, description="TTFT/TPOT samples kept per model and step (then sampled)"
    )
    refresh_seconds: float = Field(default=2.0, ge=0.5, le=60, description="how often the page reloads")

    @model_validator(mode="after")
    def _steps(self) -> Self:
        if self.window_seconds < 2 * self.step_seconds:
            raise ValueError("window_seconds must be at least twice step_seconds")
        return self


class LoopSettings(_Section):
    """Loop detection (proxy/observe/repetition.py): counts answers that repeat themselves in
    infertap_degenerate_responses_total. Off by default: it makes the SSE scanner parse every
    output event's JSON until `window_chars` of text are collected (cost: docs/doctor.md)."""

    enabled: bool = False
    window_chars: int = Field(default=2000, ge=100, le=100_000, description="text scored per answer")
    ngram: int = Field(default=4, ge=2, le=16, description="words per n-gram")
    threshold: float = Field(default=0.5, gt=0, le=1, description="repeated n-gram share that flags a loop")
    min_tokens: int = Field(default=40, ge=1, description="shorter answers are not scored")


class ClientSettings(_Section):
    """Who sent a request: the `client` label (docs/spend.md). With client keys the name comes from
    the key (`[auth]`); without them, an optional trusted header may name the client."""

    header: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9-]+$",
        description="trusted header naming the client when no client keys are set (e.g. X-Infertap-Client)",
    )
    max_clients: int = Field(
        default=100, ge=1, description="distinct client names from the header; the rest is 'other'"
    )


class PriceSettings(_Section):
    """Prices per million tokens for the models matching `models` (globs on the requested model)."""

    models: list[str] = Field(min_length=1, description="glob patterns; the first matching entry wins")
    input_per_mtok: float = Field(ge=0, description="per million prompt tokens not served from cache")
    cached_input_per_mtok: float | None = Field(
        default=None, ge=0, description="per million cached prompt tokens (default: input_per_mtok)"
    )
    output_per_mtok: float = Field(ge=0, description="per million completion tokens, reasoning included")


class SpendSettings(_Section):
    """What the tokens cost, from these prices only (no pricing service is ever called)."""

    currency: str = Field(default="USD", min_length=1, max_length=16)
    prices: list[PriceSettings] = Field(default_factory=list)
    daily_budget: float | None = Field(
        default=None, gt=0, description="per client and day, exported for the budget alert"
    )
    budgets: dict[str, float] = Field(
        default_factory=dict, description="per-client daily budgets (client name -> amount)"
    )

    @field_validator("budgets")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, x in v.items() if x <= 0)
        if bad:
            raise ValueError(f"budgets must be positive: {bad}")
        return v


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
    timeouts: dict[str, float | None] = Field(default_factory=dict, description="overrides [timeouts]")
    retry: dict[str, float] = Field(default_factory=dict, description="overrides [retry]")

    @field_validator("timeouts")
    @classmethod
    def _known_timeouts(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        unknown = set(v) - set(TimeoutSettings.model_fields) - {"read"}
        if unknown:
            raise ValueError(
                f"unknown timeout(s) {sorted(unknown)}; known: {sorted(TimeoutSettings.model_fields)}"
            )
        return v

    @field_validator("retry")
    @classmethod
    def _known_retry(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = set(v) - set(RetrySettings.model_fields)
        if unknown:
            raise ValueError(
                f"unknown retry setting(s) {sorted(unknown)}; known: {sorted(RetrySettings.model_fields)}"
            )
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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="INFERTAP_",
        env_nested_delimiter="__",
        extra="forbid",
        toml_file=None,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    circuit: CircuitSettings = Field(default_factory=CircuitSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    loops: LoopSettings = Field(default_factory=LoopSettings)
    ui: UISettings = Field(default_factory=UISettings)
    clients: ClientSettings = Field(default_factory=ClientSettings)
    spend: SpendSettings = Field(default_factory=SpendSettings)
    sim_config: str | None = Field(
        default=None, description="engine config.toml for the embedded simulated engine"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Without the TOML source added here, `toml_file` would be silently ignored.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        names = [u.name for u in self.upstreams]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"upstream names must be unique, repeated: {', '.join(dupes)}")
        if sum(u.default for u in self.upstreams) > 1:
            raise ValueError("at most one upstream may have default = true")
        for up in self.upstreams:
            missing = [f for f in up.fallback if f not in names or f == up.name]
            if missing:
                raise ValueError(f"upstream {up.name!r}: fallback names no other upstream: {missing}")
        return self


class ConfigError(Exception):
    """A configuration problem, worded for the person who wrote the config."""


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check its spelling and section)"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


_ENV_PREFIX = "INFERTAP_"


def _env_problems(environ: Mapping[str, str]) -> list[str]:
    """INFERTAP_SECTION__KEY variables whose section does not exist. pydantic-settings ignores them
    (it only looks up the fields it has), so a typo would silently leave the default in place."""
    sections = {name.upper() for name in Settings.model_fields}
    lines = []
    for var in sorted(environ):
        upper = var.upper()
        if not upper.startswith(_ENV_PREFIX) or "__" not in upper:
            continue
        section, _, rest = upper[len(_ENV_PREFIX) :].partition("__")
        if section in sections:
            continue
        close = difflib.get_close_matches(section, sections, n=1)
        hint = f"; did you mean {_ENV_PREFIX}{close[0]}__{rest}?" if close else ""
        lines.append(f"  {var}: unknown field (check its spelling and section){hint}")
    return lines


def _settings_error(err: SettingsError) -> str:
    """pydantic-settings' own errors (a variable that is not valid JSON, say), worded for a person."""
    found = re.search(r'field "(\w+)" from source "(\w+)"', str(err))
    cause = f": {err.__cause__}" if err.__cause__ is not None else ""
    if found and found.group(2) == "EnvSettingsSource":
        var = f"{_ENV_PREFIX}{found.group(1).upper()}"
        return f"invalid configuration (environment): {var} is not valid JSON{cause}"
    return f"invalid configuration: {err}{cause}"


def load_settings(config: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Load settings from `config` (or $INFERTAP_CONFIG), the environment and `overrides`.

    Raises ConfigError with a message that names the field at fault.
    """
    path = config if config is not None else os.environ.get("INFERTAP_CONFIG")
    source = "defaults and environment"
    if path:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise ConfigError(
                f"{p} is a directory: --config takes a config.toml file (see config.example.toml)"
            )
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            with p.open("rb") as fh:
                tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p} is not valid TOML: {e}") from None
    problems = _env_problems(os.environ)
    if problems:
        raise ConfigError("\n".join(["invalid configuration (environment):", *problems]))
    bound = type("Settings", (Settings,), {"model_config": {**Settings.model_config, "toml_file": path}})
    try:
        settings: Settings = bound(**overrides)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None
    except SettingsError as e:
        raise ConfigError(_settings_error(e)) from None
    return settings


def with_upstreams(settings: Settings, upstreams: list[UpstreamSettings]) -> Settings:
    """A copy of `settings` with these upstreams, validated as a whole."""
    data = {**settings.model_dump(), "upstreams": [u.model_dump() for u in upstreams]}
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, "upstreams")) from None


def parse_upstream_flag(value: str) -> UpstreamSettings:
    """`--upstream NAME=URL` or a bare URL (its name is then derived from the host)."""
    name, sep, url = value.partition("=")
    if not sep or "://" in name:
        url = value
        host = urlsplit(value).hostname or "upstream"
        name = "taotoken" if host == TAOTOKEN_HOST else host
    try:
        return UpstreamSettings(name=name, base_url=url)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, f"--upstream {value}")) from None
