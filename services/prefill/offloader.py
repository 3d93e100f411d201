"""Blocks this worker's prefix cache evicts go to the store instead of being lost.

The store and the prefill workers' caches then act as one cache, not as copies of each other:
the store evicts first the handoff copies a worker still holds (`writer_keeps_copy`) and keeps
what a worker let go. On the engine thread, just before an evicted page is reused, its block is
copied into a staging page (a memcpy); this task writes staged blocks to the store in batches and
frees their staging pages. With every staging page taken, an evicted block is dropped (counted).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

import torch

from pdserve import logs
from pdserve.kv.hashing import BlockHash
from pdserve.worker.bootstrap import Worker

log = logs.get("offload")

BATCH_BLOCKS = 64  # per store round trip


class Offloader:
    """Owns the staging pages and the queue of evicted blocks on their way to the store."""

    def __init__(self, worker: Worker, staging_blocks: int):
        self.w = worker
        cache = worker.engine.engine.kv_cache
        self.cache = cache.tensor
        self.staging = torch.empty((staging_blocks, *cache.layout.block_shape), dtype=cache.tensor.dtype)
        self.block_nbytes = cache.layout.block_nbytes
        self._lock = threading.Lock()  # the engine thread stages, the event loop sends
        self._free: deque[int] = deque(range(staging_blocks))
        self._queued: deque[tuple[BlockHash, int]] = deque()
        self.dropped = 0  # evicted with no staging page free, or the store refused them
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """From the event loop. Attaches to the engine's block pool: the engine thread reads the
        hook at its next eviction."""
        if len(self._free) == 0:
            return
        self.w.transfer.register(self.staging)
        self._loop = asyncio.get_running_loop()
        self.w.engine.engine.scheduler.pool.on_evict = self.stage
        self._task = asyncio.create_task(self._run(), name="offload")

    def stage(self, page: int, block_hash: BlockHash) -> None:
        """Engine thread: `page` is about to be reused; keep a copy of its block for the store."""
        with self._lock:
            if not self._free:
                self.dropped += 1
                if self.dropped % 1000 == 1:
                    log.warning("evicted blocks dropped: every staging page is in flight to the store "
                                "(raise --offload-blocks)", dropped=self.dropped)
                return
            slot = self._free.popleft()
        self.staging[slot].copy_(self.cache[page])
        with self._lock:
            idle = not self._queued  # otherwise the sender has yet to drain the queue: no wake-up needed
            self._queued.append((block_hash, slot))
        if idle:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while await self.send_once():
                pass

    async def send_once(self) -> int:
        """Write up to BATCH_BLOCKS staged blocks to the store; returns how many were taken."""
        with self._lock:
            batch = [self._queued.popleft() for _ in range(min(BATCH_BLOCKS, len(self._queued)))]
        if not batch:
            return 0
        slots = [slot for _, slot in batch]
        try:
            store = self.w.store
            # One put may not name a block twice: a block evicted, recomputed and evicted again.
            first = {}
            for i, (h, _) in enumerate(batch):
                first.setdefault(h, i)
            keep = sorted(first.values())
            base = self.staging.data_ptr()
            await store.put([batch[i][0] for i in keep], [base + slots[i] * self.block_nbytes for i in keep],
                            request_id="offload", lease_ms=self.w.cfg.lease_ms)
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - the next batches still go
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # this task itself is stopping (a call cut short under it is not)
            with self._lock:
                self.dropped += len(batch)
            log.warning("offload to the store failed; these evicted blocks are lost", blocks=len(batch),
                        error=str(e)[:200] or type(e).__name__)
        finally:
            with self._lock:
                self._free.extend(slots)
        return len(batch)
