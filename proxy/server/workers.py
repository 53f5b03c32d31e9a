"""--workers N: uvicorn's supervisor (SIGTERM passed on at once), the worker factory (settings
handed down resolved; a reload shared between workers), the instance's metrics directory and the
operator API's listener."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.supervisors import Multiprocess

from proxy.control import reload_sharing as peers
from proxy.server.logs import configure_logging
from proxy.server.options import reloader
from proxy.settings import ConfigError, Settings

if TYPE_CHECKING:
    from proxy.app import InfertapApp

log = logging.getLogger("infertap")

SETTINGS_ENV = "INFERTAP_SETTINGS_JSON"  # hands resolved settings to worker processes
ARGV_ENV = "INFERTAP_SERVE_ARGV"  # and the command line, so that a worker can reload the file


def app_from_env() -> InfertapApp:
    """uvicorn factory for worker processes: settings come resolved from the parent. A worker that
    uvicorn restarts (on SIGHUP to the supervisor) reads the file again."""
    from proxy.app import create_app
    from proxy.control.reload import merged

    settings = Settings.model_validate_json(os.environ[SETTINGS_ENV])
    # A worker is a fresh (spawned) process: the parent's logging set-up does not reach it, and
    # without this its infertap.* lines (the access log among them) would go nowhere.
    configure_logging(settings.server.log_level)
    reload = reloader(json.loads(os.environ[ARGV_ENV])) if ARGV_ENV in os.environ else None
    # Before the file is read: a reload published in between is then applied again, not missed.
    shared = peers.Peers(os.environ[peers.ENV]) if reload is not None and peers.ENV in os.environ else None
    if reload is not None:
        try:
            settings = merged(settings, reload())[0]
        except ConfigError as e:
            log.error("the configuration file was NOT reloaded (the one at start stays): %s", e)
    app = create_app(settings, reload=reload)
    if shared is not None:
        app.share_reloads(shared)
    app.freeze_heap = True
    return app


def admin_socket(host: str, port: int) -> socket.socket:
    """The operator API's own listener ([server] admin_port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"server.admin_port {port} on {host}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


@contextmanager
def multiprocess_metrics() -> Iterator[str]:
    """A metrics directory for this instance alone, empty at start and removed at exit.

    It must be set before prometheus_client is imported (its value class is chosen then). A
    directory shared by two instances would mix their samples, so it is never reused.
    """
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    path = given or tempfile.mkdtemp(prefix="infertap-metrics-")
    if given:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    try:
        yield path
    finally:
        if not given:
            shutil.rmtree(path, ignore_errors=True)


class Supervisor(Multiprocess):
    """uvicorn's worker supervisor, but SIGTERM reaches the workers at once: its own loop passes
    signals on only every 0.5 s, and each worker's /readyz must fail the moment the pod is told to
    go. (Its later SIGTERM to each worker is a repeat, which the drain ignores.)"""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        signal.signal(signal.SIGTERM, self._sigterm)

    def _sigterm(self, signum: int, frame: object) -> None:
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signal.SIGTERM)
        self.signal_queue.append(signum)
