"""The httptools client's failures in infertap's words: the same kind and message that the aiohttp
client gives for the same situation (proxy/transport/aiohttp_client.py), so messages, metrics and
circuits read the same whichever client runs."""

from __future__ import annotations

import logging
import os
import socket
import ssl

import httptools

from proxy.core.errors import ErrorKind, UpstreamError

log = logging.getLogger("infertap.transport")

CLOSED = "closed the connection"
MALFORMED = "sent malformed HTTP"


def idle_timeout() -> UpstreamError:
    return UpstreamError(ErrorKind.IDLE_TIMEOUT, None, "sent nothing within the idle timeout")


def connect_timeout() -> UpstreamError:
    return UpstreamError(ErrorKind.CONNECT_TIMEOUT, None, "did not accept a connection in time")


def invalid_url() -> UpstreamError:
    return UpstreamError(ErrorKind.CONNECT_ERROR, None, "is unreachable: the URL is not valid")


def connect_error(exc: BaseException) -> UpstreamError:
    """Opening the connection failed (TCP, the proxy's tunnel, TLS)."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, ssl.SSLCertVerificationError):
        what = "is unreachable: its TLS certificate did not verify"
    elif isinstance(exc, ssl.SSLError):
        what = "is unreachable: the TLS handshake failed"
    elif isinstance(exc, socket.gaierror):
        what = "is unreachable: its host does not resolve"
    elif isinstance(exc, OSError):
        reason = _os_reason(exc)
        what = f"is unreachable: {reason}" if reason else "is unreachable"
    else:
        return error(exc)
    return UpstreamError(ErrorKind.CONNECT_ERROR, None, what)


def lost(exc: BaseException | None) -> UpstreamError:
    """The connection ended before the answer did: closed (None) or broken (the socket's error)."""
    if exc is None:
        return UpstreamError(ErrorKind.STREAM_INTERRUPTED, None, CLOSED)
    return error(exc)


def error(exc: BaseException) -> UpstreamError:
    """The client's `error(exc)`: anything a send or a read raised."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, httptools.HttpParserError | httptools.HttpParserUpgrade):
        return UpstreamError(ErrorKind.UPSTREAM_5XX, None, MALFORMED)
    if isinstance(exc, OSError):
        reason = _os_reason(exc)
        return UpstreamError(
            ErrorKind.STREAM_INTERRUPTED,
            None,
            f"broke the connection ({reason})" if reason else "broke the connection",
        )
    # A bug here: the class name goes to infertap's log for whoever fixes it; the client still
    # reads infertap's words.
    log.warning("unexpected exception from the upstream client: %s", type(exc).__name__)
    return UpstreamError(ErrorKind.UPSTREAM_5XX, None, "failed in a way infertap does not know")


def _os_reason(err: BaseException) -> str:
    code = getattr(err, "errno", None)
    return os.strerror(code).lower() if isinstance(code, int) and code > 0 else ""
