"""File descriptors: the process's limit, and how many client connections fit under it.

Every client connection is a descriptor. Distributions start services with a soft limit of 1,024 (the
hard limit is usually far higher): about 1,000 idle connections then stopped the service (accept() failed
with EMFILE, so a normal request waited 14 s behind them). At start-up the soft limit is raised to the
hard limit, and the HTTP server caps its client connections below it (`http.max_connections`), leaving
a reserve for what else needs descriptors: worker connections, etcd, log and model files, the listener.
"""

from __future__ import annotations

import logging

log = logging.getLogger("orchestrator.serve")

try:
    import resource
except ImportError:  # not a POSIX system: no limit to raise
    resource = None  # type: ignore[assignment]

RESERVE_MIN = 64  # descriptors kept for everything but client connections, at least
RESERVE_SHARE = 0.1  # and at least this share of the limit
_UNLIMITED_TARGET = 1 << 20  # the soft limit to ask for when the hard one is unlimited (macOS)


def open_files_limit() -> int | None:
    """The soft RLIMIT_NOFILE in force (None: unknown or unlimited)."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_open_files_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit in force afterwards (None: unknown)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, _UNLIMITED_TARGET)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # e.g. above the kernel's nr_open, or macOS's OPEN_MAX
        log.warning("could not raise the open files limit from %d to %d: %s", soft, target, exc)
        return soft
    log.info("open files limit raised from %d to %d", soft, target)
    return target


def connection_cap(configured: int | None, descriptor_limit: int | None) -> int | None:
    """How many client connections to allow: `configured` (http.max_connections), never closer to the
    descriptor limit than its reserve; by default the limit less the reserve (None: no cap, limit unknown)."""
    if descriptor_limit is None:
        return configured
    available = max(1, descriptor_limit - max(RESERVE_MIN, int(descriptor_limit * RESERVE_SHARE)))
    if configured is None:
        return available
    if configured > available:
        log.warning("http.max_connections %d does not fit under the open files limit of %d (a reserve of %d is "
                    "kept for workers, etcd and files): capping client connections at %d", configured,
                    descriptor_limit, descriptor_limit - available, available)
        return available
    return configured
