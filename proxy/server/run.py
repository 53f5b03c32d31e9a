"""Running the proxy under uvicorn: one process, or a supervisor and N workers."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from typing import Any

import uvicorn

from proxy import compiled
from proxy.control import reload_sharing as peers
from proxy.server.options import reloader
from proxy.server.uvicorn_server import Server
from proxy.server.workers import ARGV_ENV, SETTINGS_ENV, Supervisor, admin_socket, multiprocess_metrics
from proxy.settings import ConfigError, Settings

log = logging.getLogger("infertap")


def run(settings: Settings, argv: list[str] | None = None) -> None:
    s = settings.server
    # Which hot path runs (proxy/compiled/): compiled, infertap's own work is two fifths (a request)
    # to three quarters (a paced stream) less (docs/benchmarks.md).
    log.info("hot path: %s", compiled.state)
    common: dict[str, Any] = dict(
        host=s.host,
        port=s.port,
        log_level=s.log_level,
        access_log=False,
        lifespan="on",
        loop="uvloop",
        http="proxy.server.edge:EdgeProtocol",
        server_header=False,
        # No X-Forwarded-* rewriting: infertap does not use the client address, and the middleware
        # is one more layer on every request.
        proxy_headers=False,
        # The app's drain (proxy/control/drain.py) ends the requests still open at [server] drain_timeout,
        # each with a visible error; uvicorn's own cancel is only the backstop behind it.
        timeout_graceful_shutdown=math.ceil(s.drain_timeout) + 5,
    )
    if s.workers == 1:
        from proxy.app import create_app

        app = create_app(settings, reload=reloader(argv) if argv is not None else None)
        app.freeze_heap = True
        config = uvicorn.Config(app, **common)
        # Bind before start-up: uvicorn would run the lifespan (and log "Application startup
        # complete.") before finding the port taken. Several workers: uvicorn binds first itself.
        try:
            sock = config.bind_socket()
        except SystemExit:  # uvicorn has logged the OS error
            raise ConfigError(
                f"cannot listen on {s.host}:{s.port}: another process (another infertap?) has it, or the "
                "address is not this machine's; choose another with --port or [server] port"
            ) from None
        sockets = [sock]
        if s.admin_port:
            sockets.append(admin_socket(s.admin_host, s.admin_port))
        Server(config).run(sockets=sockets)
        return
    os.environ[SETTINGS_ENV] = settings.model_dump_json()
    if argv is not None:
        os.environ[ARGV_ENV] = json.dumps(argv)
    with multiprocess_metrics() as path, tempfile.TemporaryDirectory(prefix="infertap-reload-") as shared:
        # POST /admin/reload is answered by one worker; what it applies, the others follow.
        peers.prepare(shared)
        os.environ[peers.ENV] = shared
        log.info("%d workers; metrics aggregated through %s", s.workers, path)
        factory = "proxy.server.workers:app_from_env"
        config = uvicorn.Config(factory, factory=True, workers=s.workers, **common)
        sockets = [config.bind_socket()]
        if s.admin_port:
            sockets.append(admin_socket(s.admin_host, s.admin_port))
        load = reloader(argv) if argv is not None else None
        Supervisor(config, sockets, settings, load, shared).run()
