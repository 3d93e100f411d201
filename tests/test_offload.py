"""Offload: a prefill worker saves cached blocks to the store before evicting them, and the store
evicts first the handoff copies a worker still holds, so that the two act as one cache."""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.engine.block_pool import BlockPool
from services.kvstore.entries import DRAM, SHED_AFTER, Entry, EvictionOrder
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
    order = EvictionOrder()
    made = {key: Entry(key, DRAM, 0, committed=True, duplicate=copy)
            for key, copy in ((b"l1", False), (b"c1", True), (b"l2", False), (b"c2", True), (b"l3", False))}
    for entry in made.values():
        order.add(entry)
    order.touch(made[b"l1"])
    order.touch(made[b"c1"])  # a copy keeps its place among the copies
    order.discard(made[b"l3"])
    order.discard(made[b"l3"])  # discarding twice counts once
    order.add(made[b"l2"])  # in the order already: keeps its place
    assert len(order) == 4
    assert [order.pop_first().key for _ in range(4)] == [b"c1", b"c2", b"l2", b"l1"]
    assert len(order) == 0 and all(e.order_stamp == 0 for e in made.values())
    with pytest.raises(KeyError):
        order.pop_first()


def test_the_eviction_order_sheds_its_dead_items_and_keeps_its_order():
    order = EvictionOrder()
    entries = [Entry(bytes([i]) * 16, DRAM, i, committed=True) for i in range(10)]
    for entry in entries:
        order.add(entry)
    for _ in range(3000):  # readers pin and unpin: every touch leaves a dead item behind
        for entry in entries[:5]:
            order.touch(entry)
    assert len(order) == 10 and len(order._items[1]) <= 2 * 10 + SHED_AFTER
    assert [order.pop_first().key[0] for _ in range(10)] == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


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
