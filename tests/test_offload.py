"""Offload: a prefill worker saves cached blocks to the store before evicting them, and the store
evicts first the handoff copies a worker still holds, so that the two act as one cache."""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.kv.checksum import checksum_of
from services.kvstore.memory import TierMemory
from services.kvstore.store import DEVICE, DRAM, BlockStore
from tests.support.stack import Stack, run, store_stats
from tests.test_disagg import expected, prompt, run_one


def test_pool_tells_of_each_evicted_block_before_reusing_its_page():
    pool = BlockPool(4)
    pages = pool.allocate(3)
    for i, page in enumerate(pages):
        pool.cache(page, bytes([i]) * 16)
    pool.free(pages)  # evictable, least recently used first: the tail (2), then 1, then 0
    seen = []
    pool.on_evict = lambda page, h: seen.append((page, h, pool.hash_of(page)))
    assert pool.allocate(2) == [3, pages[2]]  # the free page first, then the LRU one
    assert seen == [(pages[2], bytes([2]) * 16, None)]  # its hash is gone from the cache by then
    pool.allocate(2)
    assert [h for _, h, _ in seen] == [bytes([2]) * 16, bytes([1]) * 16, bytes([0]) * 16]
    assert pool.num_cached_blocks == 0


def test_store_evicts_copies_first_oldest_first_then_least_recently_used():
    store = BlockStore(TierMemory("device", 5, 8), TierMemory("dram", 0, 8))
    l1, c1, l2, c2, l3 = (bytes([i]) * 16 for i in range(5))  # l*: the store's own blocks; c*: copies kept
    for key, copy in ((l1, False), (c1, True), (l2, False), (c2, True), (l3, False)):
        lease, _ = store.allocate_put("w", [key], None, 0, "r", writer_keeps_copy=copy)
        store.commit("w", lease.lease_id, [key], [checksum_of(store.blocks.view(store.blocks.get(key)))])
    assert store.blocks.order(DEVICE) == [c1, c2, l1, l2, l3]
    for key in (l1, c1):  # read: most recently used (a copy keeps its place among the copies)
        lease, _, _ = store.get("r", [key], None, 0, "r")
        store.release("r", lease.lease_id)
    assert store.blocks.order(DEVICE) == [c2, c1, l2, l3, l1]
    lease, _ = store.allocate_put("w", [c2], None, 0, "r")  # an offload of a copy: the store's own now
    assert store.blocks.order(DEVICE) == [c1, l2, l3, l1, c2]
    lease, _ = store.allocate_put("w", [bytes([9]) * 16, bytes([8]) * 16], None, 0, "r")  # room for two: c1, l2 go
    assert store.blocks.order(DEVICE) == [l3, l1, c2] and store.blocks.get(c1) is None
    assert store.counters.evictions == {DEVICE: 2, DRAM: 0}


def duplicates(stack: Stack) -> int:
    return sum(t.duplicate_blocks for t in run(store_stats(stack.store.address)).tiers)


@pytest.mark.parametrize("staging", ["0", "64"])
def test_evicted_blocks_go_to_the_store(shared_redis_url, tiny, staging):
    """A 5-block prompt, then two 16-block prompts through a 24-page prefill cache: the second
    evicts A's 5 pages and 8 of the first's. With offload, every handoff block is in the store as
    a copy its writer keeps, and the 13 evicted ones are no longer copies (the worker let them go:
    the store keeps them before any copy). Without, none is a copy: a writer that never puts
    back what it evicts keeps no copy the store could drop first. The repeat of A is served from
    the store, exactly."""
    stack = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(
        prefill_flags=("--num-blocks", "24", "--offload-blocks", staging))
    try:
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.engine import LLMEngine

        engine = LLMEngine(tiny, EngineConfig(num_blocks=256))
        a = prompt(80, salt=1)
        tokens, first, _ = run(run_one(stack, "a1", a))
        assert tokens == expected(engine, a) and first.response.usage.computed_tokens == 80
        for i, n in enumerate((256, 256)):
            p = prompt(n, salt=10 + i)
            assert run(run_one(stack, f"b{i}", p))[0] == expected(engine, p)
        want = 5 + 16 + 16 - 13 if staging != "0" else 0
        deadline = time.time() + 5
        while duplicates(stack) != want and time.time() < deadline:
            time.sleep(0.05)
        assert duplicates(stack) == want
        tokens, first, _ = run(run_one(stack, "a2", a))
        u = first.response.usage
        assert tokens == expected(engine, a)
        assert (u.cached_tokens_local, u.cached_tokens_store, u.computed_tokens) == (0, 79, 1)
    finally:
        stack.stop()
