"""The SSE scanner's instructions per read, counted by valgrind's callgrind: the work a paced
stream does once a token (and a fast stream once a read), for changes to proxy/core/sse.py.

  .venv/bin/python scripts/perf/scanner_instructions.py LABEL=TREE [LABEL=TREE ...]
  e.g. .venv/bin/python scripts/perf/scanner_instructions.py before=/tmp/before after=.

For each tree and case, the case's read is fed to one scanner N times under callgrind, and 0 times,
and the difference over N is printed: what one read costs (with its loop's few instructions).
The reads are the bench upstream's vLLM-shaped deltas, after two that start the stream:

  paced        one event a read (`stream_options` asked by the client, as the bench's load does)
  paced-strip  the same, the scanner removing the usage null infertap asked for (the client did not)
  ten          ten events a read, as a zero-delay stream's reads hold

Needs Debian's valgrind. The counts move by a few instructions between runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CASES = ("paced", "paced-strip", "ten")
N = 20_000


def _feed(tree: str, case: str, n: int) -> None:
    sys.path.insert(0, tree)
    from proxy.core.sse import SSEScanner
    from proxy.tools.bench.upstream import _event

    chunked = _event({"content": "tok "})
    event = chunked[chunked.find(b"\r\n") + 2 : -2]  # the bench writes each event as one chunk
    scanner = SSEScanner(strip_usage_only=case == "paced-strip")
    read = event * 10 if case == "ten" else event
    scanner.feed(event)
    scanner.feed(event)
    feed = scanner.feed
    for _ in range(n):
        feed(read)


def _count(tree: str, case: str, n: int) -> int:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable]
    cmd += [__file__, "--feed", tree, case, str(n)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tree).stderr
    m = re.search(r"Collected : (\d+)", out)
    assert m is not None, out
    return int(m.group(1))


def main() -> None:
    if sys.argv[1:2] == ["--feed"]:
        _feed(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    if len(sys.argv) < 2 or any("=" not in a for a in sys.argv[1:]):
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        label, tree = arg.split("=", 1)
        tree = str(Path(tree).resolve())
        for case in CASES:
            per_read = (_count(tree, case, N) - _count(tree, case, 0)) / N
            print(f"{label} {case}: {per_read / 1000:.1f}k instructions per read", flush=True)


if __name__ == "__main__":
    main()
