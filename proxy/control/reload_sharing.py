"""With --workers N, one worker's reload reaches the others (POST /admin/reload is answered by one).

The supervisor makes a directory for the instance (`prepare`). The worker that reloads writes the
configuration it loaded there (JSON, replaced atomically) and then bumps a generation counter in a
shared, memory-mapped file. Each worker compares that counter with the one it last applied before
it handles a request (one memory read: no file access, no lock) and, when it is behind, applies the
published configuration as its own reload would: requests in flight keep what they started with,
and kept upstreams keep their breakers. So once the reload is answered, every worker's next
request follows it: no worker restart. An idle worker looks every PEER_POLL_SECONDS as well, so
what it shows outside requests (its background checks, its share of the metrics) follows too.

Publishing holds an exclusive lock, so two reloads at once cannot interleave: the one published
last is what every worker ends on. The files hold no secret (settings name key variables only).
"""

from __future__ import annotations

import fcntl
import mmap
import os

ENV = "INFERTAP_RELOAD_DIR"  # hands the directory to worker processes
# How often an idle worker looks for another's reload (a busy one looks before every request).
PEER_POLL_SECONDS = 0.5
_GENERATION = "generation"
_SETTINGS = "settings.json"


def prepare(path: str) -> None:
    """In the supervisor, before the workers start: generation 0, nothing published."""
    with open(os.path.join(path, _GENERATION), "wb") as f:
        f.write(bytes(8))


class Peers:
    """One worker's view of the shared reload state."""

    def __init__(self, path: str) -> None:
        self._settings = os.path.join(path, _SETTINGS)
        self._fd = os.open(os.path.join(path, _GENERATION), os.O_RDWR)
        self._map = mmap.mmap(self._fd, 8)
        self._generation = memoryview(self._map).cast("Q")
        # A worker (re)started later reads the file itself at start: it is not behind.
        self.seen: int = self._generation[0]

    def behind(self) -> bool:
        """Another worker published a reload this one has not applied (checked on every request)."""
        return self._generation[0] != self.seen

    def take(self) -> str:
        """The configuration published last, as JSON; marks it applied."""
        # The counter before the file: a publish in between gives the newer file with the older
        # counter, so the next request applies it again (harmless), never an older file as newer.
        # Marked first: should the read fail, the caller says so once, not on every request.
        self.seen = self._generation[0]
        with open(self._settings, encoding="utf-8") as f:
            return f.read()

    def publish(self, text: str) -> None:
        """Called by the worker that reloaded, after it applied `text` itself."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            tmp = f"{self._settings}.{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self._settings)
            self.seen = self._generation[0] + 1
            self._generation[0] = self.seen
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._generation.release()
        self._map.close()
        os.close(self._fd)
