"""Settings, the whole document: defaults < config.toml < INFERTAP_* environment < command-line
flags; and loading it, with errors worded for the person who wrote the file."""

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
    Field,
    ValidationError,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from proxy.settings.sections import (
    TAOTOKEN_HOST,
    AuthSettings,
    CircuitSettings,
    ClientSettings,
    LoopSettings,
    MetricsSettings,
    RetrySettings,
    ServerSettings,
    SpendSettings,
    TimeoutSettings,
    TracingSettings,
    UISettings,
)
from proxy.settings.upstreams import UpstreamSettings


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
        assert isinstance(init_settings, InitSettingsSource)
        return (
            _Init(settings_cls, init_settings.init_kwargs),
            _Env(settings_cls),
            _Toml(settings_cls),
        )

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


def _one_spelling(data: dict[str, Any]) -> dict[str, Any]:
    """[timeouts] `read` is `idle`'s other name (the seed client's word), in every source alike. Each
    source's spelling is made `idle` before the sources are merged, so that whichever spelling each
    uses, the environment wins over the file as for any other field (merged first, the two
    spellings would be two fields, one of them unknown). Both in one source stays an error."""
    timeouts = data.get("timeouts")
    if isinstance(timeouts, dict) and "read" in timeouts and "idle" not in timeouts:
        data = {**data, "timeouts": {("idle" if k == "read" else k): v for k, v in timeouts.items()}}
    return data


class _Init(InitSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _one_spelling(super().__call__())


class _Env(EnvSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _one_spelling(super().__call__())


class _Toml(TomlConfigSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _one_spelling(super().__call__())


# The sections that a reload (POST /admin/reload, SIGHUP) applies to new requests; others need a restart.
RELOADABLE = ("upstreams", "timeouts", "retry", "circuit", "auth")


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
    if found and found.group(2) == _Env.__name__:
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
