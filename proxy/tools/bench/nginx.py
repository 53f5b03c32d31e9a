"""nginx as the bench's reference proxy: the same load through `proxy_buffering off`, on infertap's core.

A streaming reverse proxy in C that does no more than relay bytes is what "overhead" should be
compared with: the targets of `infertap bench` are ratios to it. Debian's `nginx-light` is enough
(scripts/install_bench_tools.sh installs it where it can); without nginx the bench skips the row
and says so.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from proxy.tools.bench.processes import _popen, _stop, free_port, pin_child, process_tree, wait_ready

INSTALL_HINT = "install Debian's nginx-light (scripts/install_bench_tools.sh, as root) for the nginx row"

# One worker (one core, like infertap), upstream connections kept alive and reused as infertap's
# pool does, nothing buffered either way: what a streaming deployment of nginx in front of an
# engine looks like. The access log stays on, as it does by default (and as infertap's does).
_CONF = """\
worker_processes 1;
worker_rlimit_nofile 20000;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    upstream bench {{
        server 127.0.0.1:{upstream_port};
        keepalive 2048;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


class Nginx:
    """`nginx -g 'daemon off;'` with a generated config in a temporary prefix."""

    def __init__(self, label: str, exe: str, upstream_port: int, cpu: int | None, nofile: int | None) -> None:
        self.label = label
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="infertap-bench-nginx-"))
        conf = self.dir / "nginx.conf"
        conf.write_text(_CONF.format(dir=self.dir, port=self.port, upstream_port=upstream_port))
        cmd = [exe, "-p", str(self.dir), "-c", str(conf), "-g", "daemon off;"]
        self.log = (self.dir / "stderr.log").open("wb")
        self.proc = _popen(cmd, nofile, stdout=subprocess.DEVNULL, stderr=self.log)
        self.pinned = pin_child(self.proc.pid, cpu)  # before it forks its worker, which inherits it
        self.pids = [self.proc.pid]

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        def answers() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
            except OSError:
                return False
            return True

        wait_ready(
            self.proc,
            answers,
            timeout_s,
            lambda: (
                f"nginx did not listen on 127.0.0.1:{self.port} within {timeout_s:.0f} s (exit code "
                f"{self.proc.poll()}): {self.stderr_tail()}; run the bench with --no-nginx to skip it"
            ),
        )
        self.refresh_pids()

    def refresh_pids(self) -> list[int]:
        self.pids = process_tree(self.proc.pid)
        return self.pids

    def stderr_tail(self) -> str:
        text = ""
        for name in ("stderr.log", "error.log"):
            path = self.dir / name
            if path.exists():
                text += path.read_text(errors="replace")[-1000:]
        return text.strip()

    def close(self) -> None:
        _stop(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
