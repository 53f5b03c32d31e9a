"""--workers N: uvicorn's supervisor (SIGTERM passed on at once), the worker factory (settings
handed down resolved; a reload shared between workers), the instance's metrics directory and the
operator API's listener."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.supervisors import Multiprocess, multiprocess

from proxy.control import reload_sharing as peers
from proxy.server.logs import configure_logging
from proxy.server.options import reloader
from proxy.server.uvicorn_server import Server
from proxy.settings import ConfigError, Settings

if TYPE_CHECKING:
    from proxy.app import InfertapApp

log = logging.getLogger("infertap")

SETTINGS_ENV = "INFERTAP_SETTINGS_JSON"  # hands resolved settings to worker processes
ARGV_ENV = "INFERTAP_SERVE_ARGV"  # and the command line, so that a worker can reload the file


def app_from_env() -> InfertapApp:
    """uvicorn factory for worker processes: settings come resolved from the parent. A worker that
    starts later (uvicorn replaces one that died) adopts the last reload another worker published,
    never the file as it is then (proxy/control/reload.py: adopt_published)."""
    from proxy.app import create_app
    from proxy.control.reload import adopt_published

    settings = Settings.model_validate_json(os.environ[SETTINGS_ENV])
    # A worker is a fresh (spawned) process: the parent's logging set-up does not reach it, and
    # without this its infertap.* lines (the access log among them) would go nowhere.
    configure_logging(settings.server.log_level)
    reload = reloader(json.loads(os.environ[ARGV_ENV])) if ARGV_ENV in os.environ else None
    shared = peers.Peers(os.environ[peers.ENV]) if reload is not None and peers.ENV in os.environ else None
    if shared is not None:
        settings = adopt_published(settings, shared)
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


# What infertap leaves in the metrics directory: prometheus_client's value files (one per metric
# kind and process, `counter_1234.db`, `gauge_livesum_1234.db`, ...) and the bounded labels' files.
_OWN_FILES = re.compile(r"(counter|histogram|summary|gauge_[a-z]+)_\d+\.db|infertap_[a-z_]+\.txt")


@contextmanager
def multiprocess_metrics() -> Iterator[str]:
    """A metrics directory for this instance alone, empty at start and removed at exit.

    It must be set before prometheus_client is imported (its value class is chosen then). A
    directory shared by two instances would mix their samples, so it is never reused: one that
    PROMETHEUS_MULTIPROC_DIR names is emptied of infertap's own files (a previous run's) at start,
    and refused when it holds anything else (it is somebody else's: /tmp, say).
    """
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    path = given or tempfile.mkdtemp(prefix="infertap-metrics-")
    if given:
        _empty_own(given)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    try:
        yield path
    finally:
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def _empty_own(path: str) -> None:
    """Remove a previous run's files from `path`, or refuse it (ConfigError) when it holds others."""
    if not os.path.exists(path):
        os.makedirs(path, mode=0o700)
        return
    if not os.path.isdir(path):
        raise ConfigError(
            f"PROMETHEUS_MULTIPROC_DIR={path} is not a directory: name an empty directory of its own for "
            "this infertap, or unset it (infertap then makes a temporary one)"
        )
    others = sorted(name for name in os.listdir(path) if not _OWN_FILES.fullmatch(name))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ConfigError(
            f"PROMETHEUS_MULTIPROC_DIR={path} holds files that are not infertap's metrics ({shown}); "
            "infertap empties that directory at start and will not delete them: name an empty "
            "directory of its own for this infertap, or unset PROMETHEUS_MULTIPROC_DIR (infertap then "
            "makes a temporary one)"
        )
    for name in os.listdir(path):
        if _OWN_FILES.fullmatch(name):
            try:
                os.unlink(os.path.join(path, name))
            except FileNotFoundError:
                pass


class WorkerProcess(multiprocess.Process):
    """uvicorn's worker process, serving with infertap's Server (proxy/server/uvicorn_server.py: a main loop
    asleep until told to exit, not waking ten times a second)."""

    @property
    def server(self) -> Server:
        if self._server is None:
            self._server = Server(config=self.config)
        return self._server  # type: ignore[return-value]


class Supervisor(Multiprocess):
    """uvicorn's worker supervisor, but SIGTERM reaches the workers at once: its own loop passes
    signals on only every 0.5 s, and each worker's /readyz must fail the moment the pod is told to
    go. (Its later SIGTERM to each worker is a repeat, which the drain ignores.)

    SIGHUP reloads the configuration as POST /admin/reload does: loaded and checked here, then
    published to the workers (none restarts). uvicorn's own SIGHUP restarts every worker, each
    reading the file as it is then: a broken file would have put them all back on the start-up
    settings, undoing every reload since."""

    def __init__(
        self,
        config: uvicorn.Config,
        sockets: list[socket.socket],
        start: Settings,
        reload: Callable[[], Settings] | None = None,
        shared: str | None = None,
    ) -> None:
        super().__init__(config, sockets)
        # uvicorn's supervisor makes its workers (at start, on a restart, to replace one that died)
        # from its module's `Process`: in this process only, ours.
        multiprocess.Process = WorkerProcess  # type: ignore[misc]
        signal.signal(signal.SIGTERM, self._sigterm)
        self.start = start
        self.reload = reload
        self.peers = peers.Peers(shared, worker=False) if shared is not None and reload is not None else None

    def _sigterm(self, signum: int, frame: object) -> None:
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signal.SIGTERM)
        self.signal_queue.append(signum)

    def handle_hup(self) -> None:
        # Imported here: prometheus_client (which the reload's modules import) must come after
        # PROMETHEUS_MULTIPROC_DIR is set (multiprocess_metrics).
        from proxy.control.reload import publish_reload

        if self.peers is None or self.reload is None:
            log.warning("SIGHUP: this infertap was started without a configuration to reload")
            return
        try:
            generation, built = publish_reload(self.peers, self.start, self.reload)
        except ConfigError as e:
            log.error("SIGHUP: the configuration was NOT reloaded (the running one stays): %s", e)
            return
        except Exception:  # the supervisor must go on whatever a reload does
            log.exception("SIGHUP: the configuration was NOT reloaded (the running one stays)")
            return
        restart = built.restart_needed
        log.warning(
            "SIGHUP: configuration reloaded (generation %d): applied %s%s; every worker applies it "
            "before its next request",
            generation,
            ", ".join(built.applied) or "nothing",
            f"; changed but needing a restart: {', '.join(restart)}" if restart else "",
        )

    def run(self) -> None:
        try:
            super().run()
        finally:
            if self.peers is not None:
                self.peers.close()
