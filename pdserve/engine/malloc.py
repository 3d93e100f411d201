"""Keep freed memory in the process heap, so per-step buffers do not page-fault every step.

glibc returns large blocks (≥ 128 KiB by default) to the kernel with munmap as soon as they are
freed, so each decode step's multi-MiB activations and KV gathers come back as fresh pages that
fault in on first touch. On small VMs that doubles the step time. Raising the mmap and trim
thresholds keeps those blocks in the heap for the next step (what jemalloc/tcmalloc do for
PyTorch CPU inference). Process-wide, applied once; a no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # grow the heap in large steps


@functools.cache
def keep_freed_memory() -> bool:
    """Returns whether the setting took (False off glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)
