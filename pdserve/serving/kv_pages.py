"""Where a worker's KV pages are, for the transfer engine, and a cheap per-block checksum."""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVCache


class PageAddresses:
    def __init__(self, cache: KVCache):
        self.base = cache.tensor.data_ptr()
        self.block_nbytes = cache.layout.block_nbytes
        self.cache = cache

    def of(self, block_ids: list[int]) -> list[int]:
        return [self.base + b * self.block_nbytes for b in block_ids]


def block_checksums(cache: KVCache, block_ids: list[int]) -> list[int]:
    """One int64 per page: the wrapping sum of its 8-byte words, position-weighted (catches swaps)."""
    if not block_ids:
        return []
    pages = cache.tensor[torch.tensor(block_ids, dtype=torch.long)].reshape(len(block_ids), -1)
    words = pages.view(torch.int64) if pages.element_size() * pages.shape[1] % 8 == 0 else pages.view(torch.uint8)
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64) | 1
    return (words.to(torch.int64) * weights).sum(dim=1).tolist()
