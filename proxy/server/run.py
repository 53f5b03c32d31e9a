"""`infertap serve`: load settings, pick upstreams (or start the embedded engine), run uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import uvicorn
from pydantic import ValidationError
from uvicorn.supervisors import Multiprocess

from proxy import __version__
from proxy.control import reload_sharing as peers
from proxy.server.os_limits import raise_nofile
from proxy.settings import (
    TAOTOKEN_BASE_URL,
    ConfigError,
    ServerSettings,
    Settings,
    UpstreamSettings,
    load_settings,
    parse_upstream_flag,
    with_upstreams,
)

if TYPE_CHECKING:
    from proxy.app import InfertapApp

log = logging.getLogger("infertap")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_SETTINGS_ENV = "INFERTAP_SETTINGS_JSON"  # hands resolved settings to worker processes
_ARGV_ENV = "INFERTAP_SERVE_ARGV"  # and the command line, so that a worker can reload the file
_SIM_READY = "infertap-sim listening on "

EPILOG = """\
examples:
  infertap serve                                   # embedded simulated engine, no GPU or key needed
  infertap serve --upstream http://127.0.0.1:8000/v1               # in front of a local vLLM
  TAOTOKEN_API_KEY=sk-... infertap serve           # in front of TaoToken (https://taotoken.net/api)
  infertap serve --config config.toml --workers 4

Then point any OpenAI client at http://HOST:PORT/v1 (only base_url changes).
Settings: defaults < config.toml (--config or $INFERTAP_CONFIG) < INFERTAP_* env (nested with __,
e.g. INFERTAP_SERVER__PORT=9000) < flags. See config.example.toml.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infertap serve",
        description="Run the infertap proxy: an OpenAI-compatible endpoint that relays every request "
        "to an upstream and measures TTFT, TPOT, tokens and failures.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080; 0 picks a free one)")
    p.add_argument("--config", metavar="PATH", help="config.toml (default: $INFERTAP_CONFIG)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an upstream's OpenAI base URL, e.g. vllm=http://127.0.0.1:8000/v1 (repeatable; "
        "replaces the config's upstreams; the first one is the default route)",
    )
    p.add_argument("--workers", type=int, help="worker processes (default 1)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    p.add_argument("--version", action="version", version=f"infertap {__version__}")
    return p


# Flags that set a [server] field; validated like the file, and errors name the flag.
_SERVER_FLAGS = {"host": "--host", "port": "--port", "workers": "--workers", "log_level": "--log-level"}


def _server_flags(settings: Settings, args: argparse.Namespace) -> None:
    changes = {f: getattr(args, f) for f in _SERVER_FLAGS if getattr(args, f) is not None}
    if not changes:
        return
    try:
        settings.server = ServerSettings.model_validate({**settings.server.model_dump(), **changes})
    except ValidationError as e:
        err = e.errors()[0]
        flag = _SERVER_FLAGS.get(str(err["loc"][0]), str(err["loc"][0]))
        raise ConfigError(f"{flag} {err['input']}: {err['msg']}") from None


def _upstream_flags(values: list[str]) -> list[UpstreamSettings]:
    """Bare URLs on one host would share its name: those take host:port (then a number) instead."""
    ups = [parse_upstream_flag(v) for v in values]
    taken: set[str] = set()
    for up, value in zip(ups, values, strict=True):
        if up.name in taken and "=" not in value.split("://", 1)[0]:
            parts = urlsplit(up.base_url)
            name = f"{up.name}:{parts.port}" if parts.port else up.name
            n = 2
            while name in taken:
                name, n = f"{up.name}-{n}", n + 1
            up.name = name
        taken.add(up.name)
    return ups


def resolve_settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config)
    _server_flags(settings, args)
    if args.upstream:
        settings = with_upstreams(settings, _upstream_flags(args.upstream))
    if not settings.upstreams and os.environ.get("TAOTOKEN_API_KEY"):
        base = os.environ.get("TAOTOKEN_BASE_URL") or TAOTOKEN_BASE_URL
        settings.upstreams = [
            UpstreamSettings(name="taotoken", base_url=base, api_key_env="TAOTOKEN_API_KEY")
        ]
        log.info("no upstream configured and TAOTOKEN_API_KEY is set: routing to TaoToken")
    return settings


@contextmanager
def embedded_engine(settings: Settings) -> Iterator[str]:
    """Start `infertap sim` as a child on a free loopback port; yield its base URL."""
    # It stands in for whatever model a client names: accept any (a standalone sim does not).
    cmd = [sys.executable, "-m", "proxy", "sim", "--host", "127.0.0.1", "--port", "0", "--accept-any-model"]
    if settings.sim_config:
        cmd += ["--config", settings.sim_config]
    # --exit-with-stdin: the child stops when this pipe closes, which happens however this process
    # ends (even SIGKILL), so no simulated engine outlives its proxy.
    child = subprocess.Popen(
        [*cmd, "--exit-with-stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.startswith(_SIM_READY):
            raise ConfigError(f"the embedded simulated engine did not start (exit {child.poll()}): {line!r}")
        yield line[len(_SIM_READY) :].strip()
    finally:
        child.terminate()
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()


def reloader(argv: list[str]) -> Callable[[], Settings]:
    """What POST /admin/reload and SIGHUP apply: the command line resolved again (the file, the
    environment, the flags)."""

    def load() -> Settings:
        return resolve_settings(build_parser().parse_args(argv))

    return load


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    # LOG_FORMAT uses none of these, and each costs every record (the access log writes one per
    # request): the caller's frame, the thread, the process (logging's documented optimisations).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def app_from_env() -> InfertapApp:
    """uvicorn factory for worker processes: settings come resolved from the parent. A worker that
    uvicorn restarts (on SIGHUP to the supervisor) reads the file again."""
    from proxy.app import create_app
    from proxy.control.reload import merged

    settings = Settings.model_validate_json(os.environ[_SETTINGS_ENV])
    # A worker is a fresh (spawned) process: the parent's logging set-up does not reach it, and
    # without this its infertap.* lines (the access log among them) would go nowhere.
    configure_logging(settings.server.log_level)
    reload = reloader(json.loads(os.environ[_ARGV_ENV])) if _ARGV_ENV in os.environ else None
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


def _admin_socket(host: str, port: int) -> socket.socket:
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


def run(settings: Settings, argv: list[str] | None = None) -> None:
    s = settings.server
    common = dict(
        host=s.host,
        port=s.port,
        log_level=s.log_level,
        access_log=False,
        lifespan="on",
        loop="uvloop",
        http="httptools",
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
        config = uvicorn.Config(app, **common)  # type: ignore[arg-type]
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
            sockets.append(_admin_socket(s.admin_host, s.admin_port))
        uvicorn.Server(config).run(sockets=sockets)
        return
    os.environ[_SETTINGS_ENV] = settings.model_dump_json()
    if argv is not None:
        os.environ[_ARGV_ENV] = json.dumps(argv)
    with multiprocess_metrics() as path, tempfile.TemporaryDirectory(prefix="infertap-reload-") as shared:
        # POST /admin/reload is answered by one worker; what it applies, the others follow.
        peers.prepare(shared)
        os.environ[peers.ENV] = shared
        log.info("%d workers; metrics aggregated through %s", s.workers, path)
        config = uvicorn.Config("proxy.server.run:app_from_env", factory=True, workers=s.workers, **common)  # type: ignore[arg-type]
        sockets = [config.bind_socket()]
        if s.admin_port:
            sockets.append(_admin_socket(s.admin_host, s.admin_port))
        _Supervisor(config, sockets=sockets).run()


class _Supervisor(Multiprocess):
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
        if settings.upstreams:
            run(settings, argv)
            return 0
        with embedded_engine(settings) as url:
            log.info(
                "no upstream configured: routing to the embedded simulated engine at %s "
                "(configure [[upstreams]], --upstream or TAOTOKEN_API_KEY for a real one)",
                url,
            )
            settings = with_upstreams(settings, [UpstreamSettings(name="sim", base_url=url)])
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
