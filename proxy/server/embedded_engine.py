"""The embedded simulated engine: `infertap serve` with no upstream configured starts `infertap sim` as
a child and routes to it."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from proxy.settings import ConfigError, Settings

log = logging.getLogger("infertap")

_SIM_READY = "infertap-sim listening on "


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
