"""The seam's implementations (the interface is proxy/core/seam.py): the only package that imports an
HTTP client library. Two: on httptools (h1_client.py, the default) and on aiohttp
(aiohttp_client.py); `[server] upstream_client` chooses."""

from collections.abc import Callable

from proxy.core.seam import UpstreamClient
from proxy.transport.aiohttp_client import AiohttpClient
from proxy.transport.h1_client import H1Client

CLIENTS: dict[str, Callable[[], UpstreamClient]] = {"httptools": H1Client, "aiohttp": AiohttpClient}

__all__ = ["CLIENTS", "AiohttpClient", "H1Client"]
