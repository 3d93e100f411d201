"""Offload: a prefill worker saves cached blocks to the store before evicting them, and the store
evicts first the handoff copies a worker still holds, so that the two act as one cache."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from pdserve.engine.block_pool import BlockPool
from services.kvstore.memory import TierMemory
from services.kvstore.order import SHED_AFTER, EvictionOrder
from services.kvstore.table import BlockTable
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


def _rows(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_store_evicts_copies_first_oldest_first_then_least_recently_used():
    table = BlockTable(TierMemory("device", 0, 8), TierMemory("dram", 5, 8))
    order = EvictionOrder(table)
    l1, c1, l2, c2, l3 = range(5)  # rows: l* the store's own blocks, c* copies their writers keep
    table.duplicate[[c1, c2]] = True
    order.add(_rows(l1, c1, l2, c2, l3))
    order.touch(_rows(l1))
    order.touch(_rows(c1))  # a copy keeps its place among the copies
    order.discard(_rows(l3))
    order.discard(_rows(l3))  # discarding twice counts once
    order.add(_rows(l2))  # in the order already: keeps its place
    assert len(order) == 4 and order.ids() == [c1, c2, l2, l1]
    assert order.peek(1) == ([c1], [l2])
    assert order.pop(3).tolist() == [c1, c2, l2]
    assert order.pop(1).tolist() == [l1]
    assert len(order) == 0 and not table.stamp.any()
    with pytest.raises(KeyError):
        order.pop(1)


def test_the_eviction_order_sheds_its_dead_items_and_keeps_its_order():
    table = BlockTable(TierMemory("device", 0, 8), TierMemory("dram", 10, 8))
    order = EvictionOrder(table)
    order.add(np.arange(10))
    for _ in range(3000):  # readers pin and unpin: every touch leaves dead items behind
        order.touch(np.arange(5))
    queued = sum(len(ids) for q in order._queues for ids, _ in q)
    assert len(order) == 10 and queued <= 2 * 10 + SHED_AFTER
    assert order.pop(10).tolist() == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


def duplicates(stack: Stack) -> int:
    return sum(t.duplicate_blocks for t in run(store_stats(stack.store.address)).tiers)


@pytest.mark.parametrize("staging", ["0", "64"])
def test_evicted_blocks_go_to_the_store(shared_redis_url, tiny, staging):
    """A 5-block prompt, then two 16-block prompts through a 24-page prefill cache: the second
    evicts A's 5 pages and 8 of the first's. Every handoff block is in the store as a copy its
    writer keeps; with offload, the 13 evicted ones are no longer copies (the worker let them go:
    the store keeps them before any copy). The repeat of A is served from the store, exactly."""
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
        want = 5 + 16 + 16 - (13 if staging != "0" else 0)
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
