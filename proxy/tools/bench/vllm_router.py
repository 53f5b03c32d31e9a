"""vLLM's own router (`vllm-router` on PyPI, written in Rust) as a reference row of the bench.

It is what people put in front of a vLLM fleet, so it is the row infertap's balancing and its cost
per request are compared with: beside nginx in the throughput scenarios (one worker: the bench
upstream), and with its round_robin, power_of_two and cache_aware policies in front of the fleet
scenario's simulated engines. scripts/install_bench_tools.sh installs it into a venv of its own
(.bench-tools/vllm-router/, so that its pinned dependencies never meet infertap's); without it the
bench skips its rows and says so.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from proxy.tools.bench.processes import ServerProcess, _popen, free_port, pin_child, wait_ready

ROOT = Path(__file__).resolve().parents[3]
VENV_EXE = ROOT / ".bench-tools" / "vllm-router" / "bin" / "vllm-router"
INSTALL_HINT = "scripts/install_bench_tools.sh installs vllm-router into .bench-tools/vllm-router/"
POLICIES = ("round_robin", "power_of_two", "cache_aware")


def find_vllm_router() -> str | None:
    """INFERTAP_BENCH_VLLM_ROUTER, else the bench tools' venv, else one on PATH."""
    named = os.environ.get("INFERTAP_BENCH_VLLM_ROUTER")
    if named:
        return named if os.access(named, os.X_OK) else None
    if os.access(VENV_EXE, os.X_OK):
        return str(VENV_EXE)
    return shutil.which("vllm-router")


class VllmRouter(ServerProcess):
    """`vllm-router --worker-urls ... --policy P` on a free port, its Prometheus port another free one
    (the default, 29000, would collide between two routers)."""

    TAIL = 1500

    def __init__(
        self,
        label: str,
        exe: str,
        workers: list[str],
        policy: str = "round_robin",
        cpu: int | None = None,
        nofile: int | None = None,
    ) -> None:
        self.label = label
        self.port = free_port()
        cmd = [
            exe, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *workers,
            "--policy", policy, "--prometheus-port", str(free_port()), "--log-level", "warning",
            # It polls each worker's /health before it routes; every 30 s by default.
            "--worker-startup-check-interval", "1",
            # The bench measures routing, not the router's own retries or queue.
            "--disable-retries",
        ]  # fmt: skip
        self.log = tempfile.TemporaryFile()
        self.proc = _popen(cmd, nofile, stdout=subprocess.DEVNULL, stderr=self.log)
        self.pinned = pin_child(self.proc.pid, cpu)  # before tokio starts its threads
        self.pids = [self.proc.pid]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        def answers() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            except (OSError, http.client.HTTPException):
                return False
            finally:
                conn.close()

        wait_ready(
            self.proc,
            answers,
            timeout_s,
            lambda: (
                f"vllm-router ({self.label}) did not answer /health on 127.0.0.1:{self.port} within "
                f"{timeout_s:.0f} s (exit code {self.proc.poll()}): {self.stderr_tail()}; run the bench "
                "with --no-vllm-router to skip it"
            ),
        )
        self.refresh_pids()

    def stderr_tail(self) -> str:
        return super().stderr_tail().strip()
