"""Steady CPU timings: keep freed tensor memory in the process heap (glibc only).

glibc's malloc serves large blocks (a dynamic threshold from 128 KiB up to 32 MiB) with fresh
``mmap`` calls and returns them with ``munmap``, so every new activation or gradient of that
size is page-faulted in again. Which tensors are large enough moves with the process's history,
and the same backward then takes one of two quite different times (measured on the CPU executor
benchmark: a stage's split input-gradient 4.8-6.3 ms from call to call, 4.5-4.6 ms with the
thresholds pinned). Pinning the mmap threshold at its 32 MiB maximum and the trim threshold at
1 GiB keeps such blocks in the heap for reuse, as a GPU caching allocator does.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def steady_cpu_allocator() -> bool:
    """Pin glibc's mmap and trim thresholds for this process (once); False where the C
    library is not glibc (nothing changed)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
    except (OSError, AttributeError, TypeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                       2**30))
    _done = ok
    return ok
