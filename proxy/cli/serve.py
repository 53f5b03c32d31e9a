"""`infertap serve`: load settings, pick upstreams (or start the embedded engine), run uvicorn."""

from __future__ import annotations

import logging
import signal
import sys

from proxy.server.embedded_engine import embedded_engine
from proxy.server.exposure import refuse_open_beyond_loopback
from proxy.server.logs import configure_logging
from proxy.server.options import build_parser, resolve_settings
from proxy.server.os_limits import raise_nofile
from proxy.server.run import run
from proxy.settings import ConfigError, UpstreamSettings, with_upstreams

log = logging.getLogger("infertap")


class _Terminated(Exception):
    """SIGTERM arrived. uvicorn shuts down gracefully on it and then raises the signal again; under
    the default disposition that would end the process at once and skip the cleanup in main (the
    embedded engine, the multiprocess metrics directory). As an exception, the `finally` blocks run."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    raise_nofile()
    configure_logging(args.log_level or "info")
    try:
        settings = resolve_settings(args)
        refuse_open_beyond_loopback(settings)
        if settings.upstreams:
            run(settings, argv)
            return 0
        with embedded_engine(settings) as url:
            log.info(
                "no upstream configured: routing to the embedded simulated engine at %s "
                "(configure [[upstreams]], --upstream or TAOTOKEN_API_KEY for a real one)",
                url,
            )
            # The simulated engine is scripted by x-sim-* request headers (docs/sim.md).
            sim = UpstreamSettings(name="sim", base_url=url, forward_headers=["x-sim-*"])
            settings = with_upstreams(settings, [sim])
            run(settings, argv)
        return 0
    except ConfigError as e:
        print(f"infertap: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        # Cleaned up: now end by the signal itself, which is what a service manager expects.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        return 128 + signal.SIGTERM  # not reached
