"""The one file-limit helper: `infertap serve` and the bench's processes raise their open-file limit."""

from __future__ import annotations


def raise_nofile() -> int:
    """Raise the soft open-file limit to the hard one and return it. Each stream holds two sockets
    (client and upstream): the usual soft limit of 1024 would cap a process near 500 streams, far
    below what the hard limit allows. A no-op (returning -1) where there is no `resource` (not POSIX)."""
    try:
        import resource
    except ImportError:
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
