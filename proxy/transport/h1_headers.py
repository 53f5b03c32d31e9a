"""An answer's headers as the httptools client hands them over (h1_response.H1Response.headers).

Its own module, not compiled (proxy/compiled/): a mapping class compiled by mypyc cannot have
`Mapping[str, str]` as its base (a metaclass conflict at import).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class Headers(Mapping[str, str]):
    """Case-insensitive, first value first (as aiohttp's), built at first use from the raw pairs."""

    __slots__ = ("_d",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        d: dict[str, str] = {}
        for name, value in raw:
            d.setdefault(name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape"))
        self._d = d

    def __getitem__(self, key: str) -> str:
        return self._d[key.lower()]

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return self._d.get(key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)
