"""GET /v1/models: the union of the upstreams' model lists, each model once, marked with the first
upstream (in routing order) that lists it.

Asking every upstream on every call let a client that lists models in a loop (some SDKs do it on
start, some UIs on every page) multiply its calls by the number of upstreams. The union is kept
for [server] models_cache_seconds, for the routing it was fetched under: a reload brings a new
routing, so the next call asks again. Callers that come while a fetch is under way share it. A
union that lists nothing (every upstream failed) is not kept: the next call asks again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.control.upstream_checks import probe_models
from proxy.core.errors import UpstreamError
from proxy.core.model_routing import ModelRouter
from proxy.core.seam import UpstreamClient

log = logging.getLogger("infertap.app")

PROBE_TIMEOUT = 3.0


@dataclass(frozen=True, slots=True)
class ModelUnion:
    body: bytes  # the OpenAI list, serialized once for everyone it is served to
    listed: int
    failures: list[str]  # why an upstream's list is missing, key-free


async def fetch_union(routing: ModelRouter, client: UpstreamClient) -> ModelUnion:
    ups = routing.upstreams
    # return_exceptions: one upstream failing in an unexpected way must not cost the others' lists.
    results = await asyncio.gather(
        *(probe_models(client, u, PROBE_TIMEOUT) for u in ups), return_exceptions=True
    )
    data: list[dict[str, Any]] = []
    seen: set[Any] = set()
    failures: list[str] = []
    for up, res in zip(ups, results, strict=True):
        if isinstance(res, BaseException) and not isinstance(res, UpstreamError):
            log.error("upstream %s: its model list failed unexpectedly: %s", up.name, type(res).__name__)
            failures.append(f"{up.name}: the request failed unexpectedly (see infertap's log)")
            continue
        if isinstance(res, UpstreamError) or res.status != 200:
            failures.append(f"{up.name}: {res if isinstance(res, UpstreamError) else f'HTTP {res.status}'}")
            continue
        try:
            listed = orjson.loads(res.body).get("data", [])
        except (orjson.JSONDecodeError, AttributeError):
            failures.append(f"{up.name}: not an OpenAI model list")
            continue
        for model in listed:
            # A model two upstreams serve is listed once, under the first (routing order).
            if isinstance(model, dict) and model.get("id") not in seen:
                seen.add(model.get("id"))
                data.append({**model, "upstream": up.name})
    if failures:
        log.warning("model list incomplete: %s", "; ".join(failures))
    return ModelUnion(orjson.dumps({"object": "list", "data": data}), len(data), failures)


class ModelLists:
    """The last union, for one routing and `ttl` seconds; one fetch at a time."""

    def __init__(
        self,
        ttl: float,
        fetch: Callable[[ModelRouter, UpstreamClient], Awaitable[ModelUnion]] = fetch_union,
    ) -> None:
        self.ttl = ttl
        self.fetch = fetch
        self._routing: ModelRouter | None = None
        self._kept: ModelUnion | None = None
        self._until = 0.0
        self._pending: asyncio.Future[ModelUnion] | None = None

    async def get(self, routing: ModelRouter, client: UpstreamClient) -> ModelUnion:
        if routing is not self._routing:  # reloaded: what was kept describes the old upstreams
            self._routing, self._kept, self._pending = routing, None, None
        kept = self._kept
        if kept is not None and time.monotonic() < self._until:
            return kept
        pending = self._pending
        if pending is None:
            pending = self._pending = asyncio.ensure_future(self.fetch(routing, client))
            pending.add_done_callback(self._done)
        # Shielded: a caller that goes away does not cancel the fetch the others wait on.
        return await asyncio.shield(pending)

    def _done(self, done: asyncio.Future[ModelUnion]) -> None:
        if done is not self._pending:
            return  # a reload came meanwhile: this union is not the running routing's
        self._pending = None
        if done.cancelled() or done.exception() is not None:
            return
        union = done.result()
        if union.listed and self.ttl > 0:
            self._kept, self._until = union, time.monotonic() + self.ttl
