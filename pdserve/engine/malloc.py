"""Keep freed memory in the process heap, so per-step buffers do not page-fault every step.

glibc returns large blocks (≥ 128 KiB by default) to the kernel with munmap as soon as they are
freed, so each decode step's multi-MiB activations and KV gathers come back as fresh pages that
fault in on first touch. On small VMs that doubles the step time. Raising the mmap and trim
thresholds keeps those blocks in the heap for the next step (what jemalloc/tcmalloc do for
PyTorch CPU inference). Process-wide, applied once; a no-op where glibc is not the allocator.

Also where the engine's large, streamed memory (the KV cache, the linear weights) is asked onto
transparent huge pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # grow the heap in large steps
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Returns whether the setting took (False off glibc)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)


def huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel to back [address, address + nbytes) with transparent huge pages (where THP
    is in `madvise` mode, nothing does otherwise). Decode attention walks every page of the KV
    cache each step, 4 KiB at a time from scattered places: with 4 KiB pages each of those is a
    TLB miss and a cold prefetcher, about 20% of its time here. Call before first touch. Returns
    whether the advice took (False off Linux/glibc or for a region under 2 MiB)."""
    madvise = getattr(_libc(), "madvise", None)
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or end <= start:
        return False
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


def move_to_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Move each CPU tensor's data (`t.data`, in place) into one fresh buffer advised as
    transparent huge pages before its first touch, one tensor after another. One buffer, so that
    it is a fresh mapping rather than heap pages already faulted in as 4 KiB ones; its pages fault
    in as they are filled and each old storage goes as soon as its tensor has moved (when nothing
    else holds it), so memory peaks at the tensors plus the largest of them, not twice the
    tensors. A decode step streams every linear weight from memory: on 4 KiB pages that is a TLB
    miss per page and a hardware prefetcher that stops at each page's end (1-row decode steps of
    the 100M shape 4-9% faster on huge pages; docs/perf-log.md, S32)."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    buf = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    huge_pages(buf.data_ptr(), buf.numel())
    offset = -buf.data_ptr() % HUGE_PAGE
    with torch.no_grad():
        for t, size in zip(tensors, sizes, strict=True):
            view = buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            t.data = view.copy_(t)
            offset += size
