"""The staged KV path (a GPU worker's): pages copied through a registered host buffer on their
way to and from the store. Here a second host buffer stands in for GPU memory: the cache is a
plain CPU tensor the transfer engine never sees. Real store process, real transfer engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.errors import Unavailable
from pdserve.kvclient.store_client import StoreClient
from pdserve.worker.kv_pages import DirectPages, StagedPages, kv_pages
from tests.kv_peer import LAYOUT, PROFILE, block_data, block_hash
from tests.kvstore_support import start_store, transfer

SLOTS = 8


@pytest.fixture(scope="module")
def store(shared_redis_url):
    import uuid

    s = start_store(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}", device_blocks=16, dram_blocks=16)
    yield s
    s.stop()


@pytest.fixture
def staged():
    cache = KVCache(LAYOUT, 32)
    pages = StagedPages(cache, transfer(), SLOTS, timeout_s=0.3)
    yield cache, pages
    transfer().unregister(pages.buffer)


def page_bytes(cache: KVCache, page: int) -> torch.Tensor:
    return cache.tensor[page].view(torch.uint8).reshape(-1)


def test_blocks_go_out_and_come_back_bit_exact_through_the_same_slots(store, staged):
    cache, pages = staged
    out_pages, in_pages = [3, 9, 4, 20], [10, 11, 12, 13]
    for j, p in enumerate(out_pages):
        page_bytes(cache, p).copy_(block_data(41, j))
    hashes = [block_hash(41, j) for j in range(4)]
    slot_addresses = [pages.buffer.data_ptr() + s * LAYOUT.block_nbytes for s in range(4)]

    async def go():
        client = StoreClient(store.address, PROFILE, transfer())
        try:
            async with pages.outbound(out_pages) as addrs:
                assert addrs == slot_addresses and pages.num_free == SLOTS - 4
                put = await client.put(hashes, addrs)
            assert pages.num_free == SLOTS
            pinned = await client.pin(hashes)
            try:
                async with pages.inbound(in_pages) as addrs:
                    assert addrs == slot_addresses  # the same slots again: freed, lowest first
                    bad = await client.read_slots(pinned.slots, addrs)
            finally:
                await client.release(pinned.lease_id)
            return put, len(pinned.slots), bad
        finally:
            await client.close()

    put, found, bad = asyncio.run(go())
    assert (put.written, found, bad) == (4, 4, [])
    for j, p in enumerate(in_pages):
        assert torch.equal(page_bytes(cache, p), block_data(41, j))
    assert pages.num_free == SLOTS
    assert not page_bytes(cache, 14).any()  # no page beyond them was written


def test_a_read_that_fails_leaves_the_pages_untouched_and_gives_its_slots_back(staged):
    cache, pages = staged

    async def go():
        with pytest.raises(RuntimeError, match="transfer failed"):
            async with pages.inbound([5, 6]) as addrs:
                pages.buffer[:2].fill_(7)  # bytes landed, then the move fails
                assert len(addrs) == 2
                raise RuntimeError("transfer failed")

    asyncio.run(go())
    assert not page_bytes(cache, 5).any() and not page_bytes(cache, 6).any()
    assert pages.num_free == SLOTS


def test_a_full_buffer_waits_then_refuses_and_oversized_moves_are_refused(staged):
    cache, pages = staged

    async def go():
        async with pages.outbound(list(range(6))):
            with pytest.raises(Unavailable, match="KV staging buffer busy: 4 blocks wanted, 2 of 8 free"):
                async with pages.outbound([7, 8, 9, 10]):
                    pass
            later = pages.outbound([7, 8, 9, 10])
            waiter = asyncio.ensure_future(later.__aenter__())
            await asyncio.sleep(0.05)
            assert not waiter.done()  # it waits for slots, not refused at once
        addrs = await waiter  # the first move gave its slots back: the waiter has them
        assert len(addrs) == 4 and pages.num_free == SLOTS - 4
        await later.__aexit__(None, None, None)
        assert pages.num_free == SLOTS
        with pytest.raises(ValueError, match="9 KV blocks at once, the staging buffer holds 8"):
            async with pages.inbound(list(range(9))):
                pass

    asyncio.run(go())


def test_kv_path_auto_is_direct_for_host_pages_and_direct_refuses_others():
    cache = KVCache(LAYOUT, 4)
    direct = kv_pages(cache, transfer(), "auto", 8, 1.0)
    try:
        assert isinstance(direct, DirectPages) and direct.path == "direct"
        assert direct.of([0, 2]) == [cache.tensor.data_ptr(), cache.tensor.data_ptr() + 2 * LAYOUT.block_nbytes]
    finally:
        transfer().unregister(cache.tensor)
    meta = KVCache.__new__(KVCache)
    meta.layout, meta.tensor = LAYOUT, torch.empty((4, *LAYOUT.block_shape), device="meta")
    with pytest.raises(ValueError, match="--kv-path direct needs the KV cache in host memory, it is on meta"):
        kv_pages(meta, transfer(), "direct", 8, 1.0)
