"""An answer's headers as the httptools client hands them over (h1_response.H1Response.headers).

Compiled (proxy/compiled/), so a native class: mypyc cannot build one with `Mapping[str, str]` as
its base (a metaclass conflict at import), so it is registered as a Mapping instead, and has the
Mapping methods a caller may use written out. Built once an answer, its `get` asked about three
times: as Python they were about a fiftieth of a small request's own work.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView


class Headers:
    """Case-insensitive, first value first (as aiohttp's), built from the raw pairs."""

    __slots__ = ("_d",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        d: dict[str, str] = {}
        for name, value in raw:
            key = name.decode("latin-1").lower()
            if key not in d:
                d[key] = value.decode("utf-8", "surrogateescape")
        self._d = d

    def __getitem__(self, key: str) -> str:
        return self._d[key.lower()]

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._d.get(key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> KeysView[str]:
        return self._d.keys()

    def items(self) -> ItemsView[str, str]:
        return self._d.items()

    def values(self) -> ValuesView[str]:
        return self._d.values()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Headers):
            return self._d == other._d
        return isinstance(other, Mapping) and self._d == dict(other.items())

    def __repr__(self) -> str:
        return f"Headers({self._d!r})"


Mapping.register(Headers)
