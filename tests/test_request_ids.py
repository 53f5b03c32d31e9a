"""Request ids (proxy/core/request_ids.py): a client's sane X-Request-Id is kept; otherwise a fresh
one, UUID-shaped (some engines refuse any other), unique, its counter's low 48 bits in hex."""

from __future__ import annotations

import itertools
import uuid

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.request_ids import MAX_REQUEST_ID, RequestIds


def scope(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": "http", "headers": list(headers)}


@given(st.integers(min_value=0, max_value=2**64))
def test_a_fresh_id_is_a_uuid_whose_last_group_is_the_counter(start: int) -> None:
    ids = RequestIds()
    ids._next = itertools.count(start).__next__
    got = [ids(scope()) for _ in range(3)]
    for i, rid in enumerate(got):
        assert str(uuid.UUID(rid)) == rid  # UUID-shaped, lower case
        assert rid.rsplit("-", 1)[1] == f"{(start + i) & 0xFFFFFFFFFFFF:012x}"
    assert len(set(got)) == 3


def test_a_sane_client_id_is_kept_and_any_other_replaced() -> None:
    ids = RequestIds()
    assert ids(scope((b"x-request-id", b"abc-123"))) == "abc-123"
    for bad in (b"x" * (MAX_REQUEST_ID + 1), b"a\x1bb", b""):
        rid = ids(scope((b"x-request-id", bad)))
        assert str(uuid.UUID(rid)) == rid
