"""Give freed request-body memory back to the operating system.

glibc's malloc raises its mmap threshold dynamically after large blocks are freed, so after
a burst of multi-MiB request bodies later ones come from the heap, which is rarely returned:
RSS stays at its peak long after the storm. Pinning the threshold at 128 KiB keeps every
large buffer (request bodies, their joined copies) in its own mapping, unmapped when freed.
A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Allocations at least this large (bytes) get their own mapping.
MMAP_THRESHOLD_BYTES = 128 * 1024


def pin_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds; returns whether it applied."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    ok = bool(mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES)) and ok
    log.debug("malloc thresholds pinned: %s", ok)
    return ok
