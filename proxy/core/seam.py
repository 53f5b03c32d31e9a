"""The seam to the upstream HTTP client: what the core needs of one, and nothing of how.

The core states the interface; proxy/transport/ implements it (aiohttp today). So the core imports
no HTTP client library, and no transport module (import-linter holds both), and a scripted client
(the tests') or another implementation plugs in behind the same three types. Failures cross the
seam as `UpstreamError(kind, status, message)`, named by the error table (errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.core.errors import UpstreamError


@dataclass(frozen=True, slots=True)
class Timeouts:
    """An attempt's transport deadlines, in seconds (the ttft and total deadlines are the core's)."""

    connect: float  # to open a connection (TCP + TLS)
    pool: float  # to get a connection from the pool, on top of `connect`
    idle: float  # between two reads


@dataclass(frozen=True, slots=True)
class Pool:
    """An upstream's own connection pool: at most `limit` requests to it at once (None: the client's
    default). One pool per upstream, so long streams to one never starve another; waiting for a
    slot past `Timeouts.pool` is its own failure (ErrorKind.POOL_TIMEOUT), never the upstream's."""

    name: str
    limit: int | None = None


class UpstreamResponse(Protocol):
    """An upstream's answer: status and headers read, the body not yet."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive."""
        ...

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]: ...

    @property
    def sent_at(self) -> float | None:
        """When the request's last byte was written to the upstream's socket (time.perf_counter();
        None where the client cannot tell): where infertap's intake overhead ends."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; a failed read raises one of the client's `errors`."""
        ...

    async def read(self) -> bytes:
        """The whole body (raises UpstreamError)."""
        ...

    def release(self) -> None:
        """The body was read to its end: the connection may be reused."""

    def close(self) -> None:
        """Unread or broken: drop the connection (which is what stops an upstream generating)."""


class Piped(Protocol):
    """An optional capability of an UpstreamResponse (the httptools client's): the body handed to
    `on_data` from the connection's own receive callback, as it arrives, with no reader task.

    `pipe` first hands over whatever is already buffered, then every later read; the awaitable
    resolves when the body ends whole, or raises one of the client's `errors` (a failed read, the
    idle timeout) or what `on_data` raised. `pause_body`/`resume_body` stop and restart reading
    from the upstream's socket (the client's backpressure); the idle clock does not run meanwhile.
    `unpipe` stops the delivery (a relay that ends early); `close` still drops the connection."""

    def pipe(self, on_data: Callable[[bytes], None]) -> Awaitable[None]: ...
    def unpipe(self) -> None: ...
    def pause_body(self) -> None: ...
    def resume_body(self) -> None: ...


class Sink(Protocol):
    """An optional capability of the client side (the raw cycle's `send` is a bound method of one):
    a synchronous write for a relay driven by the upstream's callbacks, and the client's transport
    telling it when to stop and restart reading (`attach`; `detach` when the relay ends)."""

    def push(self, body: bytes) -> None:
        """One body chunk (more follow), written now; nothing once the client is gone."""

    def attach(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """`pause` when the client's transport stops taking writes (at once if it already has,
        and once the client is gone), `resume` when it takes them again."""

    def detach(self) -> None: ...


class UpstreamClient(Protocol):
    # What a read from `UpstreamResponse.chunks()` may raise besides UpstreamError.
    errors: tuple[type[BaseException], ...]

    async def send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        pool: Pool | None = None,
    ) -> UpstreamResponse:
        """Sends the request and waits for status and headers (raises UpstreamError)."""
        ...

    async def fetch(self, url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, bytes]:
        """GET a small document within `timeout` seconds in all: (status, body) (raises UpstreamError)."""
        ...

    def error(self, exc: BaseException) -> UpstreamError:
        """The UpstreamError for something `send`, `fetch` or a read raised."""
        ...

    async def close(self) -> None: ...
