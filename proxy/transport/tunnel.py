"""Environment proxies, as aiohttp's `trust_env` reads them: HTTP_PROXY for http://, HTTPS_PROXY
for https:// (either case), NO_PROXY's hosts and domains go direct. An http:// URL goes to the
proxy in absolute form; an https:// URL through a CONNECT tunnel, TLS to the upstream inside it.
Credentials in the proxy's URL (http://user:pass@proxy:3128) become Proxy-Authorization: Basic.
Only http:// proxies (as most are); netrc is not read."""

from __future__ import annotations

import asyncio
import base64
import ssl
import urllib.request
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from proxy.core.errors import ErrorKind, UpstreamError
from proxy.transport.h1_connection import H1Connection


@dataclass(frozen=True, slots=True)
class Proxy:
    host: str
    port: int
    auth: bytes  # b"proxy-authorization: Basic ...\r\n", or b""


def env_proxy(scheme: str, host: str) -> Proxy | None:
    """The proxy the environment names for `scheme` URLs to `host`, or None (direct)."""
    proxies = urllib.request.getproxies_environment()
    url = proxies.get(scheme)
    if not url or urllib.request.proxy_bypass_environment(host, proxies):  # type: ignore[attr-defined]
        return None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamError(
            ErrorKind.CONNECT_ERROR,
            None,
            f"is unreachable: its proxy ({scheme.upper()}_PROXY) is not an http:// URL",
        )
    auth = b""
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        auth = b"proxy-authorization: Basic " + base64.b64encode(pair) + b"\r\n"
    return Proxy(parts.hostname, parts.port or 80, auth)


async def open_tunnel(
    loop: asyncio.AbstractEventLoop,
    conn: H1Connection,
    target: bytes,
    proxy: Proxy,
    ctx: ssl.SSLContext,
    host: str,
) -> None:
    """Asks the proxy on `conn` for a tunnel to `target` (b"host:port"), then starts TLS inside it.
    llhttp reads the proxy's answer, like any other."""
    assert conn.transport is not None
    conn.start(idle=3600.0, slot=None, head_only=True)
    request = b"CONNECT %s HTTP/1.1\r\nhost: %s\r\n%s\r\n" % (target, target, proxy.auth)
    await conn.write(request)
    assert conn.head is not None
    await conn.head
    status = conn.parser.get_status_code()
    if status != 200:
        conn.close()
        raise UpstreamError(
            ErrorKind.CONNECT_ERROR, None, f"is unreachable: its proxy answered CONNECT with HTTP {status}"
        )
    tls = await loop.start_tls(conn.transport, conn, ctx, server_hostname=host)
    if tls is None:
        raise UpstreamError(ErrorKind.CONNECT_ERROR, None, "is unreachable: the TLS handshake failed")
    conn.transport = tls
    conn.parser = conn.new_parser()
