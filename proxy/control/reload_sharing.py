"""With --workers N, one worker's reload reaches the others (POST /admin/reload is answered by one).

The supervisor makes a directory for the instance (`prepare`). The worker that reloads writes the
configuration it loaded there (JSON, replaced atomically) and then bumps a generation counter in a
shared, memory-mapped file. Each worker compares that counter with the one it last applied before
it handles a request (one memory read: no file access, no lock) and, when it is behind, applies the
published configuration as its own reload would: requests in flight keep what they started with,
and kept upstreams keep their breakers. So once the reload is answered, every worker's next
request follows it: no worker restart. An idle worker looks every PEER_POLL_SECONDS as well, so
what it shows outside requests (its background checks, its share of the metrics) follows too. A
worker that starts later (uvicorn restarts one that died) adopts what was published last, never
the file as it is then: a file broken or edited since would set it apart from the others.

A reload holds an exclusive lock from reading the file to publishing what it read (`locked`), so
of two reloads at once the one that read the file last is the one published last: no worker ends
on an older file than a reload that was answered 200.

Acknowledgements: the shared file also holds a slot per worker (its pid, the generation it has
applied), claimed at start and freed at exit. The worker that answers a reload counts the slots
of live workers that have applied it (`acknowledged`): the answer says how many had, never how
many were told.

What is published holds secrets: the settings as loaded, with the base URLs' user info and query
strings, upstream header values and the OTLP endpoint (keys themselves stay in the environment;
settings name their variables). Sharing less would not do: a worker that re-read the file itself
could find it edited or broken since, and run apart from the others. So the directory is the
instance's own, mode 0700 (made by the supervisor with tempfile, removed at exit), and every file
in it is created 0600: readable by infertap's user alone, who can read the configuration file and
the workers' environment (INFERTAP_SETTINGS_JSON holds the same settings as at start) anyway.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from io import BufferedWriter

ENV = "INFERTAP_RELOAD_DIR"  # hands the directory to worker processes
# How often an idle worker looks for another's reload (a busy one looks before every request).
PEER_POLL_SECONDS = 0.5
# Worker slots: more than --workers allows (256), for replacements that start before the worker
# they replace has exited and for uvicorn's SIGTTIN. 16 KiB in all.
SLOTS = 1024
_STATE = "generation"
_SETTINGS = "settings.json"
_WORDS = 1 + 2 * SLOTS  # the generation, then (pid, applied generation) per slot
_PRIVATE = 0o600


def prepare(path: str) -> None:
    """In the supervisor, before the workers start: generation 0, nothing published, no slot taken."""
    os.chmod(path, 0o700)
    with _create(os.path.join(path, _STATE)) as f:
        f.write(bytes(8 * _WORDS))


def _create(path: str) -> BufferedWriter:
    """A new file only its owner may read, whatever the umask (a stale one is replaced)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE), "wb")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now has that pid: not a worker of ours
        return False
    return True


class Peers:
    """One process's view of the shared reload state: a worker's (with a slot), or the supervisor's
    (`worker=False`: it publishes on SIGHUP and applies nothing)."""

    # Slots this process holds (tests hold several in one process): a slot with this pid that is
    # not among them was left by an earlier process that had the same pid.
    _mine: set[tuple[str, int]] = set()

    def __init__(self, path: str, worker: bool = True) -> None:
        self._settings = os.path.join(path, _SETTINGS)
        self._state = os.path.realpath(os.path.join(path, _STATE))
        self._fd = os.open(self._state, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 8 * _WORDS)
        self._words = memoryview(self._map).cast("Q")
        # Nothing applied yet: a process that starts after a reload was published is behind it
        # (proxy/server/workers.py adopts it before the app is built).
        self.seen = 0
        self._slot: int | None = self._claim() if worker else None

    # -- the generation ------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """How many reloads were published (0: none; every process runs the start-up settings)."""
        return int(self._words[0])

    def behind(self) -> bool:
        """Another process published a reload this one has not applied (checked on every request)."""
        return self._words[0] != self.seen

    def take(self) -> str:
        """The configuration published last, as JSON; marks it seen (`ack` once it is applied)."""
        # The counter before the file: a publish in between gives the newer file with the older
        # counter, so the next request applies it again (harmless), never an older file as newer.
        # Marked first: should the read fail, the caller says so once, not on every request.
        self.seen = int(self._words[0])
        with open(self._settings, encoding="utf-8") as f:
            return f.read()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Held from reading the configuration file to publishing it: reloads happen one at a time,
        across every worker and the supervisor."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def publish(self, text: str) -> int:
        """Inside `locked()`, after this process applied `text` itself (or checked it: the
        supervisor). Returns the new generation."""
        tmp = f"{self._settings}.{os.getpid()}"
        with _create(tmp) as f:
            f.write(text.encode())
        os.replace(tmp, self._settings)
        self.seen = int(self._words[0]) + 1
        self._words[0] = self.seen
        self.ack()
        return self.seen

    # -- acknowledgements ---------------------------------------------------------------------
    def ack(self) -> None:
        """This worker now runs generation `seen`."""
        if self._slot is not None:
            self._words[2 + 2 * self._slot] = self.seen

    def acknowledged(self, generation: int) -> tuple[int, int]:
        """(live workers that have applied `generation` or a later one, live workers)."""
        applied = running = 0
        w = self._words
        for i in range(SLOTS):
            pid = w[1 + 2 * i]
            if pid == 0 or not _alive(pid):
                continue
            running += 1
            if w[2 + 2 * i] >= generation:
                applied += 1
        return applied, running

    def _claim(self) -> int | None:
        """A free slot (never taken, freed, or its worker gone without freeing it) for this process."""
        w = self._words
        with self.locked():
            for i in range(SLOTS):
                pid = w[1 + 2 * i]
                left = pid == os.getpid() and (self._state, i) not in Peers._mine
                if pid == 0 or left or not _alive(pid):
                    w[2 + 2 * i] = 0
                    w[1 + 2 * i] = os.getpid()
                    Peers._mine.add((self._state, i))
                    return i
        return None  # more processes than slots: this one is not counted

    def close(self) -> None:
        if self._slot is not None:
            self._words[1 + 2 * self._slot] = 0
            Peers._mine.discard((self._state, self._slot))
            self._slot = None
        self._words.release()
        self._map.close()
        os.close(self._fd)
