"""The README works as typed: every fenced shell block marked runnable is run, as a new user would.

How to mark a block (for anyone adding README content): put the word `runnable` after the fence's
language, ```` ```bash runnable ```` (GitHub shows it as plain bash). Then this test

- runs the block as one bash script (`set -euo pipefail`) from the checkout root, in a new shell:
  no virtual environment activated, no `INFERTAP_*` or `TAOTOKEN_*` variables, after the two
  set-up commands (`scripts/test` has installed `.venv`);
- treats a line ending in `&` (before any comment) as a server started in the background, as the
  README does, and waits until it listens before the next line, as a person would: on the port of
  its `--port N`, else infertap's 8080 (`scripts/serve`);
- gives every port 8000-8099 written in the block a free port instead (the same number gets the
  same port throughout the block; 8080 also reaches `scripts/serve` through INFERTAP_SERVER__PORT),
  so blocks never collide with each other or with anything running;
- fails unless every command exits 0 within the deadline, and ends what the block left running.

Leave a block unmarked only when it needs what a test machine lacks (an API key, a GPU, a Docker
daemon, the internet) or is the test suite itself (`scripts/test`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
PORT = re.compile(r"\b80\d\d\b")
BACKGROUND = re.compile(r"&\s*(#.*)?$")
DEADLINE_S = 300
WAIT = """
wait_port() {  # until something listens on 127.0.0.1:$1 (bash's /dev/tcp), for at most 60 s
  for _ in $(seq 600); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "nothing listens on port $1 after 60 s" >&2; return 1
}
"""


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, body) of each fenced shell block whose info string says `runnable`."""
    out = []
    for m in FENCE.finditer(text):
        language, info, body = m.group(1), m.group(2).split(), m.group(3)
        if "runnable" in info and language in ("bash", "sh", "shell", "console"):
            out.append((text.count("\n", 0, m.start()) + 1, body))
    return out


def script(body: str, ports: dict[str, int]) -> str:
    """The block as a bash script: its ports substituted, a wait after each background server."""
    lines, logical = [WAIT, "set -euo pipefail"], ""
    for line in PORT.sub(lambda m: str(ports.setdefault(m.group(0), free_port())), body).splitlines():
        lines.append(line)
        logical += line
        if line.endswith("\\"):
            continue
        if BACKGROUND.search(logical) and not logical.lstrip().startswith("#"):
            port = re.search(r"--port[ =](\d+)", logical)
            lines.append(f"wait_port {port.group(1) if port else ports.setdefault('8080', free_port())}")
        logical = ""
    return "\n".join(lines) + "\n"


def new_shell_env(ports: dict[str, int]) -> dict[str, str]:
    venv = str(ROOT / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv)
    env["INFERTAP_SERVER__PORT"] = str(ports.setdefault("8080", free_port()))
    return env


BLOCKS = runnable_blocks((ROOT / "README.md").read_text())


def test_the_readme_marks_its_runnable_blocks() -> None:
    bodies = "\n".join(body for _, body in BLOCKS)
    assert "scripts/serve &" in bodies and "infertap compare" in bodies and "infertap probe" in bodies


@pytest.mark.parametrize(("line", "body"), BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_runnable_block_works_as_typed(line: int, body: str, tmp_path: Path) -> None:
    ports: dict[str, int] = {}
    env = new_shell_env(ports)
    (tmp_path / "block.sh").write_text(script(body, ports))
    log = tmp_path / "output.txt"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", str(tmp_path / "block.sh")], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the servers it started end with it
        )  # fmt: skip
        try:
            code = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    output = log.read_text(errors="replace")
    assert code == 0, (
        f"README.md:{line}: the block exited {code}:\n{script(body, ports)}\n--- output ---\n{output}"
    )
