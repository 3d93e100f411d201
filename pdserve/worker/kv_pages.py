"""Where a worker's KV pages are, for the transfer engine, and a cheap per-block checksum."""

from __future__ import annotations

import functools

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.model import cpu_kernels


class PageAddresses:
    def __init__(self, cache: KVCache):
        self.base = cache.tensor.data_ptr()
        self.block_nbytes = cache.layout.block_nbytes
        self.cache = cache

    def of(self, block_ids: list[int]) -> list[int]:
        return [self.base + b * self.block_nbytes for b in block_ids]


def block_checksums(cache: KVCache, block_ids: list[int]) -> list[int]:
    """One int64 per page: the wrapping sum of its 8-byte words, position-weighted (catches swaps).
    The C kernel reads each page once; torch (the reference, where the kernel cannot be built or
    a page is not whole words) makes three passes and two temporary copies: 4-9 ms for the 128
    pages of a 2,048-token tiny prompt, CPU a decode worker's running requests wait on."""
    if not block_ids:
        return []
    if _kernel_ok(cache.tensor):
        return cpu_kernels.page_checksums(cache.tensor, block_ids)
    return reference_checksums(cache, block_ids)


@functools.cache
def _kernel_built() -> bool:
    return cpu_kernels.unbuildable() is None


def _kernel_ok(pages: torch.Tensor) -> bool:
    nbytes = pages[0].numel() * pages.element_size()
    return pages.device.type == "cpu" and pages.is_contiguous() and nbytes % 8 == 0 and _kernel_built()


def reference_checksums(cache: KVCache, block_ids: list[int]) -> list[int]:
    pages = cache.tensor[torch.tensor(block_ids, dtype=torch.long)].reshape(len(block_ids), -1)
    words = pages.view(torch.int64) if pages.element_size() * pages.shape[1] % 8 == 0 else pages.view(torch.uint8)
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64) | 1
    return (words.to(torch.int64) * weights).sum(dim=1).tolist()
