"""Bounded label values (`model`, and `client` from a trusted header): an acceptance test and a cap
on distinct values, held across worker processes.

The cap bounds how many names get a label; MAX_LABEL_CHARS and the printable test bound each one:
a name over 256 characters, or with a control character, is OTHER before it is looked up, counted
or shared, so what a client sends can neither make a line of /metrics long nor grow the shared file.

With `--workers N` each worker is a process of its own; a cap kept in each would let N times as
many values through. The admitted names are kept in a file in the instance's multiprocess
directory instead, appended to under a lock. Only a name this process has not seen yet costs
a look at the file, and each look either admits a name or finds the cap reached, after which
the file is never read again: at most cap + 1 looks per process, whatever clients send.
"""

from __future__ import annotations

import fcntl
import fnmatch
import logging
import os
import threading
from collections.abc import Iterable

from mypy_extensions import mypyc_attr

log = logging.getLogger("infertap.metrics")

OTHER = "other"
NONE = "none"
MAX_LABEL_CHARS = 256
SHARED_FILE = "infertap_model_labels.txt"  # not *.db: prometheus_client reads those


def multiprocess_dir() -> str | None:
    """The instance's multiprocess directory (set by `serve --workers N`), where workers share state."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class SharedNames:
    """Names admitted by any worker of this instance, one a line."""

    def __init__(self, directory: str, file_name: str) -> None:
        self.path = os.path.join(directory, file_name)

    def admit(self, name: str, cap: int) -> tuple[bool, set[str]]:
        """(whether `name` is admitted, every name admitted so far)."""
        with open(self.path, "a+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
            fh.seek(0)
            names = set(fh.read().split("\n"))
            names.discard("")
            if name in names:
                return True, names
            if len(names) >= cap:
                return False, names
            fh.write(name + "\n")
            names.add(name)
            return True, names


# Subclassed outside the compiled modules (proxy/compiled/).
@mypyc_attr(allow_interpreted_subclasses=True)
class BoundedLabels:
    """Maps a name to a bounded label value: the first `cap` names that `accepts` admits keep their
    own value (across the workers sharing `shared_dir`), the rest are OTHER, a missing one `missing`."""

    def __init__(
        self,
        cap: int,
        shared_dir: str | None = None,
        shared_file: str = SHARED_FILE,
        missing: str = NONE,
    ) -> None:
        self.cap = cap
        self.missing = missing
        self.seen: set[str] = set()
        self.full = False
        self.shared = SharedNames(shared_dir, shared_file) if shared_dir else None
        self._lock = threading.Lock()

    def accepts(self, name: str) -> bool:
        return True

    def __call__(self, model: str | None) -> str:
        if not model:
            return self.missing
        if len(model) > MAX_LABEL_CHARS:  # before hashing it: a name may be megabytes long
            return OTHER
        if model in self.seen:
            return model
        if not model.isprintable() or not self.accepts(model):
            return OTHER
        with self._lock:
            if self.full:
                return OTHER
            if self.shared is not None:
                try:
                    admitted, names = self.shared.admit(model, self.cap)
                except OSError as e:
                    log.warning("label cap: %s unusable (%s); counting per worker", self.shared.path, e)
                    self.shared = None
                else:
                    self.seen |= names
                    self.full = not admitted
                    return model if admitted else OTHER
            if len(self.seen) >= self.cap:
                self.full = True
                return OTHER
            self.seen.add(model)
        return model


class ModelLabels(BoundedLabels):
    """The `model` label: names matching the allow-list patterns (all, when there are none)."""

    def __init__(self, patterns: Iterable[str] | None, cap: int, shared_dir: str | None = None) -> None:
        super().__init__(cap, shared_dir)
        self.patterns = None if patterns is None else list(patterns)

    def accepts(self, name: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
