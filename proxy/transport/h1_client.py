"""The httptools implementation of the seam (proxy/core/seam.py): HTTP/1.1 over asyncio protocols,
llhttp parsing every answer, a pool of kept-alive connections per origin and each upstream's slots
(`Pool`) on top, as the aiohttp client has them.

What it does as the aiohttp client does: no redirect followed, no cookie, no decompression (the
bytes are relayed as they came), no User-Agent added, each failure in the same words
(h1_errors.py). What it adds: the pool race is nobody's failure (a reused connection that fails
before a byte of the answer arrives is asked again on a fresh one, once: h1_connection.py), and the
environment's HTTP(S)_PROXY/NO_PROXY are honoured (tunnel.py). TLS through asyncio, with the
system's trust store (ssl.create_default_context(): OpenSSL's SSL_CERT_FILE/SSL_CERT_DIR apply) and
SNI.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from proxy.core.errors import ErrorKind, UpstreamError
from proxy.core.seam import Pool, Timeouts, UpstreamResponse
from proxy.transport import h1_errors
from proxy.transport.h1_connection import H1Connection, Stale
from proxy.transport.h1_pool import IdleConnections
from proxy.transport.h1_response import H1Response
from proxy.transport.slots import Slots
from proxy.transport.tunnel import Proxy, env_proxy, open_tunnel

# Framing is the client's to state, never the caller's. (Final: compiled, read from a static, not
# looked up in the module's dict once a header.)
_OWN: Final = frozenset(("content-length", "transfer-encoding", "connection"))
_BODY_METHODS: Final = frozenset(("POST", "PUT", "PATCH"))


class Origin:
    """Where requests to one scheme://host:port go, and what their heads share, built once."""

    __slots__ = ("tls", "host", "port", "proxy", "absolute", "prefix", "host_line", "target", "idle")

    def __init__(self, prefix: str, loop: asyncio.AbstractEventLoop) -> None:
        parts = urlsplit(prefix)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise h1_errors.invalid_url()
        try:
            port = parts.port
        except ValueError:
            raise h1_errors.invalid_url() from None
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.tls else 80)
        self.prefix = prefix
        shown = f"[{self.host}]" if ":" in self.host else self.host
        authority = shown if port in (None, 443 if self.tls else 80) else f"{shown}:{self.port}"
        self.host_line = f"host: {authority}\r\n"
        self.target = f"{shown}:{self.port}".encode()
        self.proxy: Proxy | None = env_proxy(parts.scheme, self.host)
        # Plain http through a proxy: the request line names the whole URL.
        self.absolute = self.proxy is not None and not self.tls
        self.idle = IdleConnections(loop)


class H1Client:
    """Must be created inside the running event loop."""

    errors: tuple[type[BaseException], ...] = (UpstreamError,)

    def __init__(self, max_connections: int = 1000) -> None:
        self.max_connections = max_connections
        self.loop = asyncio.get_running_loop()
        self._slots = Slots(max_connections)
        self._origins: dict[str, Origin] = {}
        self._ssl: ssl.SSLContext | None = None

    def _origin(self, url: str) -> tuple[Origin, str]:
        cut = url.find("/", url.find("//") + 2) if "//" in url else -1
        prefix, path = (url, "/") if cut < 0 else (url[:cut], url[cut:])
        origin = self._origins.get(prefix)
        if origin is None:
            origin = self._origins[prefix] = Origin(prefix, self.loop)
        return origin, (prefix + path if origin.absolute else path)

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:  # costly to build (the trust store is read): once, at the first https
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        pool: Pool | None = None,
    ) -> UpstreamResponse:
        origin, target = self._origin(url)
        data = _head(method, target, origin, headers, body)
        slot = await self._slots.acquire(pool, timeouts) if pool is not None else None
        try:
            conn = origin.idle.take()
            if conn is not None:
                resp = await self._exchange(conn, data, method, timeouts, slot)
                if resp is not None:
                    return resp
            # No connection kept, or the kept one had been closed under us: a fresh one, whose
            # failure is the upstream's.
            conn = await self._connect(origin, timeouts)
            resp = await self._exchange(conn, data, method, timeouts, slot)
            assert resp is not None  # a fresh connection is never Stale
            return resp
        except BaseException:
            if slot is not None:
                slot.release()
            raise

    async def _exchange(
        self, conn: H1Connection, data: bytes, method: str, timeouts: Timeouts, slot: asyncio.Semaphore | None
    ) -> H1Response | None:
        resp = conn.start(timeouts.idle, slot, head_only=method == "HEAD")
        try:
            sent_at = await conn.write(data)
            assert conn.head is not None
            await conn.head
        except Stale:
            conn.close()
            return None
        except BaseException:
            conn.close()  # cancelled, timed out, failed: never back to the pool
            raise
        resp.sent_at = sent_at
        return resp

    async def _connect(self, origin: Origin, timeouts: Timeouts) -> H1Connection:
        loop = self.loop
        ctx = self._context() if origin.tls else None
        proxy = origin.proxy
        conn: H1Connection | None = None

        def protocol() -> H1Connection:
            nonlocal conn
            conn = H1Connection(loop, origin.idle.put)
            return conn

        try:
            async with asyncio.timeout(timeouts.connect):
                if proxy is None:
                    await loop.create_connection(
                        protocol,
                        origin.host,
                        origin.port,
                        ssl=ctx,
                        server_hostname=origin.host if ctx else None,
                    )
                else:
                    await loop.create_connection(protocol, proxy.host, proxy.port)
                    assert conn is not None
                    if ctx is not None:
                        await open_tunnel(loop, conn, origin.target, proxy, ctx, origin.host)
        except BaseException as e:
            if conn is not None:
                conn.close()
            if isinstance(e, TimeoutError):
                raise h1_errors.connect_timeout() from None
            if isinstance(e, OSError | UpstreamError):
                raise h1_errors.connect_error(e) from e
            raise
        assert conn is not None
        return conn

    async def fetch(self, url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, bytes]:
        # Never a redirect: it would carry the upstream's headers (its key, custom tokens) to
        # whatever host the answer names.
        try:
            async with asyncio.timeout(timeout):
                resp = await self.send("GET", url, headers, None, Timeouts(timeout, timeout, timeout))
                try:
                    body = await resp.read()
                except BaseException:
                    resp.close()
                    raise
                resp.release()
                return resp.status, body
        except TimeoutError as e:  # the whole call's deadline (the client's own are UpstreamErrors)
            raise UpstreamError(ErrorKind.TOTAL_TIMEOUT, None, f"did not answer within {timeout:g} s") from e

    def error(self, exc: BaseException) -> UpstreamError:
        return h1_errors.error(exc)

    async def close(self) -> None:
        for origin in self._origins.values():
            origin.idle.close()
        self._origins.clear()


def _head(method: str, target: str, origin: Origin, headers: Mapping[str, str], body: bytes | None) -> bytes:
    """The request's head: the origin's part built once, the request's own part here."""
    lines = [f"{method} {target} HTTP/1.1\r\n"]
    host = True
    for name, value in headers.items():
        low = name.lower()
        if low in _OWN:
            continue
        if low == "host":
            host = False
        lines.append(f"{name}: {value}\r\n")
    if host:
        lines.append(origin.host_line)
    if body:
        lines.append(f"content-length: {len(body)}\r\n")
    elif method in _BODY_METHODS:
        lines.append("content-length: 0\r\n")
    if origin.absolute and origin.proxy is not None and origin.proxy.auth:
        lines.append(origin.proxy.auth.decode())
    lines.append("\r\n")
    text = "".join(lines)
    # A CR or LF inside a name or value would end the head early (header injection): each line
    # holds exactly one of each. (aiohttp refuses these with a ValueError too.)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        raise ValueError("a newline or carriage return in a request header")
    data = text.encode("utf-8", "surrogateescape")
    return data + body if body else data
