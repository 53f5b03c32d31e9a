"""The aiohttp implementation of the seam (proxy/core/seam.py): one pooled session for all upstreams.

With the other transport packages to come, this is where aiohttp is imported (import-linter and
ruff's banned-API rule enforce it): its exceptions become `UpstreamError(kind, status, message)`
here, named by the error table, most specific first.

Why aiohttp: its C parser and stream reader cost a fraction of httpx's per chunk, and its pool
does not scan every connection on each request; httpx's did, and delivered 7x fewer streams per
second at 64 concurrent streams (docs/benchmarks.md, docs/architecture.md).

Per-chunk cost matters: a response's `chunks()` is the client's own iterator, not a wrapper, so a
read that fails mid-stream raises the client's exception. The core catches `client.errors` around
its reads and turns what it caught into an UpstreamError with `client.error(exc)`, once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import aiohttp

from proxy.core.errors import ErrorKind, UpstreamError
from proxy.core.seam import Pool, Timeouts, UpstreamResponse
from proxy.transport.slots import Slots

log = logging.getLogger("infertap.transport")

# Most specific first: aiohttp's exception classes form a hierarchy (its timeouts are also
# TimeoutErrors, so they must be told apart from infertap's own deadlines before those are). Each
# says what the upstream did in infertap's words: a client reads these, and "SocketTimeoutError:
# Timeout on reading data from socket" told it nothing it could act on.
_CAUSES: tuple[tuple[type[BaseException], ErrorKind, str], ...] = (
    (aiohttp.ConnectionTimeoutError, ErrorKind.CONNECT_TIMEOUT, "did not accept a connection in time"),
    (aiohttp.ServerTimeoutError, ErrorKind.IDLE_TIMEOUT, "sent nothing within the idle timeout"),
    (
        aiohttp.ClientConnectorCertificateError,
        ErrorKind.CONNECT_ERROR,
        "is unreachable: its TLS certificate did not verify",
    ),
    (aiohttp.ClientSSLError, ErrorKind.CONNECT_ERROR, "is unreachable: the TLS handshake failed"),
    (aiohttp.ClientConnectorDNSError, ErrorKind.CONNECT_ERROR, "is unreachable: its host does not resolve"),
    (aiohttp.ClientConnectorError, ErrorKind.CONNECT_ERROR, "is unreachable"),
    (aiohttp.InvalidURL, ErrorKind.CONNECT_ERROR, "is unreachable: the URL is not valid"),
    (aiohttp.ServerDisconnectedError, ErrorKind.STREAM_INTERRUPTED, "closed the connection"),
    # A body cut short: chunked encoding or Content-Length left unfinished when the connection closed.
    (aiohttp.ClientPayloadError, ErrorKind.STREAM_INTERRUPTED, "closed the connection"),
    (aiohttp.ClientResponseError, ErrorKind.UPSTREAM_5XX, "sent malformed HTTP"),
    (aiohttp.ClientOSError, ErrorKind.STREAM_INTERRUPTED, "broke the connection"),
    (aiohttp.ClientConnectionError, ErrorKind.STREAM_INTERRUPTED, "broke the connection"),
)
# The two generic socket failures add the operating system's words: "is unreachable: connection
# refused", "broke the connection (connection reset by peer)".
_WITH_OS_REASON = {aiohttp.ClientConnectorError: ": {}", aiohttp.ClientOSError: " ({})"}


def classify(exc: BaseException) -> ErrorKind:
    return _error(exc).kind


def _error(exc: BaseException) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    for exc_type, kind, what in _CAUSES:
        if isinstance(exc, exc_type):
            suffix = _WITH_OS_REASON.get(exc_type)
            reason = _os_reason(getattr(exc, "os_error", exc)) if suffix else ""
            return UpstreamError(kind, None, what + suffix.format(reason) if reason and suffix else what)
    # Not one of aiohttp's: a bug here or there. The class name goes to infertap's log for whoever
    # fixes it; the client still reads infertap's words.
    log.warning("unexpected exception from the upstream client: %s", type(exc).__name__)
    return UpstreamError(ErrorKind.UPSTREAM_5XX, None, "failed in a way infertap does not know")


def _os_reason(err: BaseException) -> str:
    """The operating system's words for a socket error ("connection refused"), or ""."""
    code = getattr(err, "errno", None)
    return os.strerror(code).lower() if isinstance(code, int) and code > 0 else ""


class _StampedRequest(aiohttp.ClientRequest):
    """aiohttp's request, noting when its last byte went to the socket. The stamp travels to the
    response in a one-slot list that refers to nothing, so no reference cycle is made for the GC."""

    _infertap_sent: list[float] | None = None

    async def send(self, conn: aiohttp.connector.Connection) -> aiohttp.ClientResponse:
        sent = self._infertap_sent = [0.0]
        resp = await super().send(conn)
        resp._infertap_sent = sent  # type: ignore[attr-defined]
        if not sent[0] and self._writer is None:  # no body left to write: the headers were all
            sent[0] = time.perf_counter()
        return resp

    async def write_bytes(
        self,
        writer: aiohttp.abc.AbstractStreamWriter,
        conn: aiohttp.connector.Connection,
        content_length: int | None = None,
    ) -> None:
        await super().write_bytes(writer, conn, content_length)
        if self._infertap_sent is not None:
            self._infertap_sent[0] = time.perf_counter()


class _Response:
    __slots__ = ("_r", "_slot", "status", "headers", "raw_headers", "sent_at")

    def __init__(self, r: aiohttp.ClientResponse, slot: asyncio.Semaphore | None) -> None:
        self._r = r
        self._slot = slot
        self.status = r.status
        self.headers: Mapping[str, str] = r.headers
        self.raw_headers: Sequence[tuple[bytes, bytes]] = r.raw_headers
        sent: list[float] | None = getattr(r, "_infertap_sent", None)
        self.sent_at: float | None = sent[0] or None if sent is not None else None

    def chunks(self) -> AsyncIterator[bytes]:
        return self._r.content.iter_any()

    async def read(self) -> bytes:
        try:
            return await self._r.read()
        except aiohttp.ClientError as e:
            raise _error(e) from e

    def release(self) -> None:
        self._r.release()
        self._free()

    def close(self) -> None:
        self._r.close()
        self._free()

    def _free(self) -> None:
        # Once, whichever of release and close comes (both may).
        if self._slot is not None:
            self._slot.release()
            self._slot = None


class AiohttpClient:
    """One aiohttp session, with a pool per upstream. Must be created inside the running event loop.

    aiohttp's connector has no limit of its own: each upstream's requests in flight are bounded
    by its own slots (`Pool`, `max_connections`; `max_connections` here is the default), so long
    streams to one upstream never make another wait, and the wait for a slot is told apart from
    connecting (aiohttp's connect timeout would include it, and blame the upstream).

    No environment proxies (a stray HTTP_PROXY would buffer streams), no cookies, no
    decompression (bytes are relayed unchanged), no redirects.
    """

    errors: tuple[type[BaseException], ...] = (aiohttp.ClientError, UpstreamError)

    def __init__(self, max_connections: int = 1000) -> None:
        self.max_connections = max_connections
        self._slots = Slots(max_connections)
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            # Expire idle connections before a typical server's 5 s keep-alive closes them under us.
            keepalive_timeout=4.0,
            ttl_dns_cache=300,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
            request_class=_StampedRequest,
        )
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}

    def _timeout(self, t: Timeouts) -> aiohttp.ClientTimeout:
        native = self._timeouts.get(t)
        if native is None:
            native = self._timeouts[t] = aiohttp.ClientTimeout(
                total=None, connect=t.connect, sock_connect=t.connect, sock_read=t.idle
            )
        return native

    async def send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        pool: Pool | None = None,
    ) -> UpstreamResponse:
        slot = await self._slots.acquire(pool, timeouts) if pool is not None else None
        try:
            r = await self.session.request(
                method,
                url,
                headers=headers,
                data=body,
                timeout=self._timeout(timeouts),
                allow_redirects=False,
            )
        except BaseException as e:
            if slot is not None:
                slot.release()
            if isinstance(e, aiohttp.ClientError):  # its timeouts are TimeoutErrors too: not ours
                raise _error(e) from e
            raise
        return _Response(r, slot)

    async def fetch(self, url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, bytes]:
        try:
            # Never a redirect: it would carry the upstream's headers (its key, custom tokens) to
            # whatever host the answer names.
            async with self.session.get(
                url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False
            ) as r:
                return r.status, await r.read()
        except aiohttp.ClientError as e:
            raise _error(e) from e
        except TimeoutError as e:  # the whole call's deadline (aiohttp's own are ClientErrors too)
            raise UpstreamError(ErrorKind.TOTAL_TIMEOUT, None, f"did not answer within {timeout:g} s") from e

    def error(self, exc: BaseException) -> UpstreamError:
        return _error(exc)

    async def close(self) -> None:
        await self.session.close()
