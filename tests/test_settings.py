"""What the configuration check lets through runs; one spelling rule for the file and the environment.

Regressions: per-upstream `timeouts` and `retry` overrides were checked only when the server
built its routing (`timeouts = {ttft = 0}` passed `load_settings`, then two tracebacks and exit 3);
`read`, `idle`'s other name, was refused as an unknown field as soon as the file and the
environment used different spellings (INFERTAP_TIMEOUTS__READ with `idle` in the file)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.model_routing import ModelRouter
from proxy.settings import ConfigError, RetrySettings, TimeoutSettings, load_settings

_TIMEOUT_KEYS = [*TimeoutSettings.model_fields, "read"]
_VALUES = st.one_of(
    st.sampled_from([0, -1, 0.5, 1, 2.5, 30, 10**6]),
    st.floats(-10, 1e4, allow_nan=False, allow_infinity=False),
)


def _table(d: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {v!r}" for k, v in d.items()) + "}"


@given(
    timeouts=st.dictionaries(st.sampled_from(_TIMEOUT_KEYS), _VALUES, max_size=3),
    retry=st.dictionaries(st.sampled_from(list(RetrySettings.model_fields)), _VALUES, max_size=3),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_an_upstream_override_that_passes_the_check_runs(
    tmp_path: Path, timeouts: dict[str, Any], retry: dict[str, Any]
) -> None:
    """Whatever an upstream's own timeouts and retry say: either the check refuses them, naming
    the field (upstreams.0.timeouts.ttft), or the server can build its routing from them."""
    path = tmp_path / "config.toml"
    path.write_text(
        '[[upstreams]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\n'
        f"timeouts = {_table(timeouts)}\nretry = {_table(retry)}\n"
    )
    try:
        loaded = load_settings(path)
    except ConfigError as e:
        named = re.findall(r"upstreams\.0\.(timeouts|retry)(?:\.(\w+))?:", str(e))
        assert named, str(e)
        for section, key in named:
            given_keys = timeouts if section == "timeouts" else retry
            assert key in given_keys or (not key and "idle" in given_keys and "read" in given_keys), str(e)
        return
    ModelRouter.from_settings(loaded)  # raised ValidationError at start-up before the fix


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("timeouts = {ttft = 0}", "upstreams.0.timeouts.ttft"),
        ("retry = {max_attempts = 0}", "upstreams.0.retry"),
    ],
)
def test_a_bad_override_is_refused_by_the_check(tmp_path: Path, override: str, named: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[[upstreams]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\n{override}\n')
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_settings(path)


_SPELLING = st.sampled_from([None, "idle", "read"])


@given(file=_SPELLING, env=_SPELLING, per_upstream=_SPELLING)
@settings(max_examples=27, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_read_and_idle_are_one_field_in_the_file_and_the_environment(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    file: str | None,
    env: str | None,
    per_upstream: str | None,
) -> None:
    """Whichever spelling the file and the environment each use, the environment wins over the
    file, as for every other field; an upstream's own `read` is its `idle` too."""
    path = tmp_path / "config.toml"
    text = f"[timeouts]\n{file} = 5\n" if file else ""
    text += '[[upstreams]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\n'
    if per_upstream:
        text += f"timeouts = {{{per_upstream} = 3}}\n"
    path.write_text(text)
    with monkeypatch.context() as m:
        for var in [v for v in os.environ if v.startswith("INFERTAP_")]:
            m.delenv(var)
        if env:
            m.setenv(f"INFERTAP_TIMEOUTS__{env.upper()}", "7")
        loaded = load_settings(path)
    assert loaded.timeouts.idle == (7.0 if env else 5.0 if file else TimeoutSettings().idle)
    up = ModelRouter.from_settings(loaded).upstreams[0]
    assert up.timeout.idle == (3.0 if per_upstream else loaded.timeouts.idle)


def test_both_spellings_in_one_place_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[timeouts]\nidle = 5\nread = 6\n")
    with pytest.raises(ConfigError, match="idle or read"):
        load_settings(path)
