"""Upstream reachability, checked in the background, and the state that /readyz and /status read.

/readyz used to GET every upstream's /models while the probe waited (3 s each); a kubelet gives a
probe 1 s, so one hung upstream took every replica out of service at once. Now the checks run on
their own schedule and the routes only read what they found.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from proxy import __version__
from proxy.core.errors import UpstreamError
from proxy.core.model_routing import ModelRouter, Upstream
from proxy.core.seam import UpstreamClient

log = logging.getLogger("infertap.health")


@dataclass(slots=True)
class Probe:
    status: int
    body: bytes


@dataclass(slots=True)
class Check:
    """The latest background check of one upstream."""

    reachable: bool
    checked_at: float  # unix seconds
    status: int | None = None
    error: str | None = None


# Names the background checks, so an upstream's logs (and the test upstream) can tell them apart.
CHECK_USER_AGENT = f"infertap/{__version__} upstream-check"


async def probe_models(
    client: UpstreamClient, up: Upstream, timeout: float, check: bool = False
) -> Probe | UpstreamError:
    """GET the upstream's model list: (status, body), or why it could not be had (key-free)."""
    headers = dict(up.headers)
    if check:
        headers["user-agent"] = CHECK_USER_AGENT
    if up.api_key:
        headers["authorization"] = f"Bearer {up.api_key}"
    try:
        return Probe(*await client.fetch(up.url("/models"), headers, timeout))
    except UpstreamError as e:
        return e


class UpstreamChecker:
    """Every `interval` seconds, GET /models on each upstream with a short timeout."""

    def __init__(self, routing: ModelRouter, client: UpstreamClient, interval: float, timeout: float) -> None:
        self.routing = routing
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.checks: dict[str, Check] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="infertap-upstream-checks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("the upstream checks failed")
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a check must never stop the checks
                log.exception("upstream check failed")
            await asyncio.sleep(self.interval)

    async def check_all(self) -> None:
        ups = self.routing.upstreams
        # return_exceptions: one upstream's check failing in an unexpected way (a bug, a client
        # library's refusal) must not cost every other upstream its check.
        results = await asyncio.gather(
            *(probe_models(self.client, up, self.timeout, True) for up in ups), return_exceptions=True
        )
        now = time.time()
        for up, res in zip(ups, results, strict=True):
            if isinstance(res, UpstreamError):
                check = Check(False, now, error=str(res))
            elif isinstance(res, BaseException):
                log.error("upstream %s: its check failed unexpectedly: %s", up.name, type(res).__name__)
                check = Check(False, now, error="the check failed unexpectedly (see infertap's log)")
            else:
                # Any HTTP answer means it is there; the status says whether it is happy.
                check = Check(True, now, res.status, None if res.status == 200 else f"HTTP {res.status}")
            before = self.checks.get(up.name)
            if before is not None and before.reachable != check.reachable:
                log.warning(
                    "upstream %s is %s", up.name, "reachable again" if check.reachable else check.error
                )
            self.checks[up.name] = check

    def status(self, draining: bool, ready: bool) -> dict[str, Any]:
        """The body of GET /status: per upstream, reachability and circuit state, with reasons."""
        now = time.monotonic()
        rows = []
        for up in self.routing.upstreams:
            check = self.checks.get(up.name)
            b = up.breaker
            calls, failures = b.counts(now)
            rows.append(
                {
                    "name": up.name,
                    "base_url": up.display_url,
                    "default": up is self.routing.default,
                    "reachable": None if check is None else check.reachable,
                    "last_check": None if check is None else check.checked_at,
                    "check_status": None if check is None else check.status,
                    "check_error": None if check is None else check.error,
                    "circuit": {
                        "state": b.state(now),
                        "why": b.describe(now) if b.is_open else None,
                        "retry_in_seconds": round(b.retry_in(now), 3),
                        "window_calls": calls,
                        "window_failures": failures,
                    },
                    "config_warnings": list(getattr(up, "config_warnings", ())),
                }
            )
            pool = getattr(up, "replicas", None)
            if pool is not None:
                rows[-1]["balance"] = pool.policy
                rows[-1]["replicas"] = pool.rows(now)
        return {"ready": ready, "draining": draining, "upstreams": rows}
