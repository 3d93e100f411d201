"""Where the transfer engine moves a worker's KV pages from and to.

Direct: the cache's own memory, registered with the transfer engine (pages in host memory).
Staged: a registered host buffer the pages are copied through (pages in GPU memory, which the
transfer engine's TCP path cannot read, and whose bytes the checksum contract needs on the host;
or, for tests, any cache). Every block a request sends or receives passes through staging slots
it holds only while its bytes move; the slots come back however the move ends.

The call sites read the same for both: `outbound(pages)` yields addresses holding the pages'
bytes, `inbound(pages)` yields addresses to land bytes at, copied into the pages when the block
ends without an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.errors import Unavailable
from pdserve.kvclient.transfer import Transfer
from pdserve.runtime.tasks import to_thread_to_end
from pdserve.worker.config import KV_PATHS


class DirectPages:
    """The pages' own addresses (the cache is registered with the transfer engine)."""

    path = "direct"

    def __init__(self, cache: KVCache, transfer: Transfer):
        if cache.tensor.device.type != "cpu":
            raise ValueError(f"--kv-path direct needs the KV cache in host memory, it is on {cache.tensor.device}: "
                             "blocks are checksummed on the host (use --kv-path staged)")
        transfer.register(cache.tensor)
        self.base = cache.tensor.data_ptr()
        self.block_nbytes = cache.layout.block_nbytes

    def of(self, block_ids: list[int]) -> list[int]:
        return [self.base + b * self.block_nbytes for b in block_ids]

    @asynccontextmanager
    async def outbound(self, pages: list[int]) -> AsyncIterator[list[int]]:
        yield self.of(pages)

    @asynccontextmanager
    async def inbound(self, pages: list[int]) -> AsyncIterator[list[int]]:
        yield self.of(pages)


class StagedPages:
    """Owns the staging buffer [num_slots, *block_shape] (pinned when the cache is on CUDA),
    registered with the transfer engine, and its free slots. Used from the event loop only; the
    copies run in a thread, on a stream of their own on CUDA."""

    path = "staged"

    def __init__(self, cache: KVCache, transfer: Transfer, num_slots: int, timeout_s: float):
        self.cache = cache.tensor
        self.block_nbytes = cache.layout.block_nbytes
        cuda = self.cache.device.type == "cuda"
        self.buffer = torch.zeros((num_slots, *cache.layout.block_shape), dtype=self.cache.dtype, pin_memory=cuda)
        transfer.register(self.buffer)
        self.base = self.buffer.data_ptr()
        self.num_slots = num_slots
        self.timeout_s = timeout_s
        self._free = list(range(num_slots))  # ascending: a request's slots tend to be one run, one slice
        self._returned = asyncio.Condition()
        self._stream = torch.cuda.Stream(self.cache.device) if cuda else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @asynccontextmanager
    async def outbound(self, pages: list[int]) -> AsyncIterator[list[int]]:
        """The pages' bytes copied into staging slots (after the compute queued so far, which
        wrote them), as addresses for the transfer engine."""
        async with self._slots(len(pages)) as slots:
            await to_thread_to_end(self._copy, slots, pages, True)  # (its slots are not handed on midway)
            yield self._addresses(slots)

    @asynccontextmanager
    async def inbound(self, pages: list[int]) -> AsyncIterator[list[int]]:
        """Staging addresses to land the pages' bytes at; copied into the pages (complete before
        this returns) when the block ends without an error, and not at all otherwise."""
        async with self._slots(len(pages)) as slots:
            yield self._addresses(slots)
            await to_thread_to_end(self._copy, slots, pages, False)  # (nor its pages)

    def _addresses(self, slots: list[int]) -> list[int]:
        return [self.base + s * self.block_nbytes for s in slots]

    @asynccontextmanager
    async def _slots(self, n: int) -> AsyncIterator[list[int]]:
        if n > self.num_slots:
            raise ValueError(f"{n} KV blocks at once, the staging buffer holds {self.num_slots} "
                             "(raise --kv-staging-blocks)")
        async with self._returned:
            try:
                await asyncio.wait_for(self._returned.wait_for(lambda: len(self._free) >= n), self.timeout_s)
            except TimeoutError:
                raise Unavailable(f"KV staging buffer busy: {n} blocks wanted, {len(self._free)} of "
                                  f"{self.num_slots} free for {self.timeout_s:.1f}s") from None
            slots, self._free = self._free[:n], self._free[n:]
        try:
            yield slots
        finally:
            self._free = sorted(self._free + slots)  # (at once: a cancel while awaiting the lock lost them)
            await asyncio.shield(self._notify())

    async def _notify(self) -> None:
        async with self._returned:
            self._returned.notify_all()

    def _copy(self, slots: list[int], pages: list[int], to_staging: bool) -> None:
        at = torch.tensor(slots, dtype=torch.long)
        ids = torch.tensor(pages, dtype=torch.long, device=self.cache.device)
        if self._stream is None:
            if to_staging:
                self.buffer.index_copy_(0, at, self.cache.index_select(0, ids))
            else:
                self.cache.index_copy_(0, ids, self.buffer.index_select(0, at))
            return
        with torch.cuda.stream(self._stream):
            # After the engine's queued kernels: they wrote these pages (outbound), or read what
            # they held before (inbound).
            self._stream.wait_stream(torch.cuda.default_stream(self.cache.device))
            if to_staging:
                self.buffer.index_copy_(0, at, self.cache.index_select(0, ids).cpu())
            else:
                self.cache.index_copy_(0, ids, self.buffer.index_select(0, at).to(self.cache.device))
            self._stream.synchronize()


def kv_pages(cache: KVCache, transfer: Transfer, path: str, staging_blocks: int,
             timeout_s: float) -> DirectPages | StagedPages:
    """--kv-path made real: `auto` is direct for pages in host memory, staged for GPU pages."""
    if path not in KV_PATHS:
        raise ValueError(f"kv_path must be one of {', '.join(KV_PATHS)}, got {path!r}")
    if path == "direct" or (path == "auto" and cache.tensor.device.type == "cpu"):
        return DirectPages(cache, transfer)
    return StagedPages(cache, transfer, staging_blocks, timeout_s)
