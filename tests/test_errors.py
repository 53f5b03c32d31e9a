"""The error table: every kind is mapped, and the strings the outside world sees stay put."""

from __future__ import annotations

import pytest

from proxy.core.errors import ERRORS, TIMEOUT_PHASES, ErrorKind, UpstreamError, outcome_of, timeout_phase
from proxy.core.exchange import Outcome


def test_every_kind_maps() -> None:
    assert set(ERRORS) == set(ErrorKind)
    for kind, info in ERRORS.items():
        assert 400 <= info.status < 600, kind
        if info.outcome is not None:
            # One string serves as retry reason, outcome label and JSON error type.
            assert info.outcome.value == kind.value, kind
            assert outcome_of(kind) is info.outcome
        if info.timeout_phase is not None:
            assert kind.value.endswith("_timeout"), kind
            # An upstream too slow is a gateway timeout; infertap's own full pool is unavailability.
            assert info.status == (503 if kind is ErrorKind.POOL_TIMEOUT else 504), kind


def test_only_the_stream_options_retry_never_ends_a_request() -> None:
    assert [k for k, i in ERRORS.items() if i.outcome is None] == [ErrorKind.STREAM_OPTIONS]
    with pytest.raises(ValueError):
        outcome_of(ErrorKind.STREAM_OPTIONS)


def test_what_counts_against_an_upstream() -> None:
    unhealthy = {k for k, i in ERRORS.items() if i.unhealthy}
    assert unhealthy == {
        ErrorKind.CONNECT_ERROR,
        ErrorKind.CONNECT_TIMEOUT,
        ErrorKind.TTFT_TIMEOUT,
        ErrorKind.IDLE_TIMEOUT,
        ErrorKind.STREAM_INTERRUPTED,
        ErrorKind.UPSTREAM_5XX,
    }


def test_timeout_phases_by_reason_and_by_outcome() -> None:
    assert TIMEOUT_PHASES == {
        "connect_timeout": "connect",
        "ttft_timeout": "ttft",
        "idle_timeout": "idle",
        "total_timeout": "total",
        "pool_timeout": "pool",
    }
    assert timeout_phase(Outcome.TOTAL_TIMEOUT.value) == "total"
    assert timeout_phase(Outcome.OK.value) is None
    # Every outcome a timeout ends in has a phase; no other does.
    timed = {o for o in Outcome if o.value.endswith("_timeout")}
    assert {o for o in Outcome if timeout_phase(o.value)} == timed


def test_upstream_error_status_from_the_table_unless_the_upstream_sent_one() -> None:
    assert UpstreamError(ErrorKind.CONNECT_TIMEOUT, None, "slow").status == 504
    e = UpstreamError(ErrorKind.UPSTREAM_5XX, 503, "upstream 'a' answered HTTP 503")
    assert (e.kind, e.status, str(e)) == (ErrorKind.UPSTREAM_5XX, 503, "upstream 'a' answered HTTP 503")
