"""Where a worker's KV pages are, for the transfer engine."""

from __future__ import annotations

from pdserve.engine.kv_cache import KVCache


class PageAddresses:
    def __init__(self, cache: KVCache):
        self.base = cache.tensor.data_ptr()
        self.block_nbytes = cache.layout.block_nbytes
        self.cache = cache

    def of(self, block_ids: list[int]) -> list[int]:
        return [self.base + b * self.block_nbytes for b in block_ids]
