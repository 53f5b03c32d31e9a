"""The seam's implementations (the interface is proxy/core/seam.py): the only package that imports an
HTTP client library."""

from proxy.transport.aiohttp_client import AiohttpClient

__all__ = ["AiohttpClient"]
