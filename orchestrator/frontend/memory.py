"""Giving the memory of a big request back to the operating system.

glibc's malloc raises its mmap threshold each time a large mmapped block is freed (up to 32 MB), so
after the first big body the next ones are carved from the heap, which keeps its freed pages: a server
that parsed a few 20 MB bodies stayed ~60 MB above its baseline for good. `use_mmap_for_big_blocks`
pins the threshold at 1 MB (blocks above it are mapped and unmapped on free), and
`release_free_memory` (`malloc_trim(0)`) returns what freed heap pages there are after a big request.
Elsewhere (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util

BIG_BODY_BYTES = 4 << 20  # a request at least this big is followed by a trim


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _libc_function(name: str):
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")


def use_mmap_for_big_blocks(threshold: int = 1 << 20) -> None:
    """Allocate blocks above `threshold` with mmap, so that freeing them returns them to the OS."""
    if _MALLOPT is not None:
        _MALLOPT(_M_MMAP_THRESHOLD, threshold)


def release_free_memory() -> None:
    """Return freed heap pages to the OS (milliseconds; run it on a worker thread)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
