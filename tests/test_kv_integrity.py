"""KV that is never served corrupt: a writer stalled past its lease, bytes flipped in the store's
memory, bytes offered again for a stored hash. Real store and worker processes, the real
transfer engine, real Redis; each test ends with a leak audit."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest
import torch

from pdserve.kvclient.store_client import StoreClient
from pdserve.kvclient.transfer import Span
from pdserve.rpc.convert import profile_from_pb
from services.router.dispatch import DispatchError
from tests.kv_peer import block_data, block_hash
from tests.kvstore_support import LocalClient, spawn_peer, start_store, tier_stats, transfer, wait_for, wait_ready
from tests.support.stack import Stack, run, store_stats
from tests.test_disagg import expected, prompt, run_one


def _assert_store_clean(c: LocalClient) -> None:
    wait_for(lambda: (s := c.stats()).active_leases == 0 and s.fenced_blocks == 0 and s.watchers == 0)
    assert all(t["pinned"] == 0 for t in tier_stats(c.stats()).values())


def test_a_writer_stalled_past_its_lease_never_gets_its_bytes_served(shared_redis_url, key_prefix):
    """The writer allocates, stalls past its lease and the quarantine, its slots go to another
    put, then it resumes: its bytes land over the other put's committed blocks and its commit is
    refused. Readers find the damage by checksum: nothing wrong is ever returned, the bad blocks
    are dropped (and counted), and what is put again reads back exact. (The store's own default
    lease, 5 s, is the test's puts': the stale writer asks for 300 ms.)"""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=1, lease_ms=5000, fence_ms=200)
    try:
        c = LocalClient(store.address)
        stale = spawn_peer("stale-put", store.address, "--seed", "50", "--n", "2", "--lease-ms", "300")
        wait_ready(stale)
        wait_for(lambda: c.stats().active_leases == 0 and c.stats().fenced_blocks == 0)  # lapsed, then unfenced
        put = c.put(51, [0, 1])  # into the slots the stale writer still holds addresses of
        assert (put.written, put.present) == (2, 0)
        out, err = stale.communicate("go\n", timeout=30)
        assert stale.returncode == 0, err[-2000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["commit"] == "FAILED_PRECONDITION" and "has lapsed" in result["details"]
        got = c.get(51, 2)
        assert got == {"num_blocks": 0, "has_tail": False, "ok": True, "slices": 1, "corrupt": 2}
        assert c.stats().corrupt_blocks == 2
        assert c.get(51, 2)["num_blocks"] == 0  # dropped: never again
        assert c.get(50, 2)["num_blocks"] == 0  # never committed
        assert c.put(51, [0, 1]).written == 2
        assert c.get(51, 2) == {"num_blocks": 2, "has_tail": False, "ok": True, "slices": 1, "corrupt": 0}
        _assert_store_clean(c)
        assert tier_stats(c.stats())["device"]["used"] == 2
    finally:
        store.stop()


def test_a_stalled_writer_inside_the_quarantine_lands_in_fenced_slots_only(shared_redis_url, key_prefix):
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=1, lease_ms=5000,
                        fence_ms=60_000)
    try:
        c = LocalClient(store.address)
        stale = spawn_peer("stale-put", store.address, "--seed", "52", "--n", "2", "--lease-ms", "300")
        wait_ready(stale)
        wait_for(lambda: c.stats().active_leases == 0)
        assert c.stats().fenced_blocks == 2
        assert c.put(53, [0, 1]).written == 2  # the other two slots
        out, _ = stale.communicate("go\n", timeout=30)
        assert json.loads(out.strip().splitlines()[-1])["commit"] == "FAILED_PRECONDITION"
        assert c.get(53, 2) == {"num_blocks": 2, "has_tail": False, "ok": True, "slices": 1, "corrupt": 0}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            c.put(55, [0, 1, 2, 3])  # two slots fenced, two evictable, one free in DRAM: no room for four
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.stats().corrupt_blocks == 0
    finally:
        store.stop()


def test_put_bytes_never_replaces_the_bytes_of_a_stored_block(small_store):
    c = LocalClient(small_store.address)
    c.put(60, [0, 1])
    other = bytes(block_data(61, 0).numpy()) + bytes(block_data(61, 1).numpy())
    resp = c.call(StoreClient.put_bytes, [block_hash(60, 0), block_hash(60, 1)], other)
    assert resp == (0, 2, 0)
    assert c.get(60, 2) == {"num_blocks": 2, "has_tail": False, "ok": True, "slices": 1, "corrupt": 0}
    n, _, data = c.call(StoreClient.get_bytes, [block_hash(60, 0), block_hash(60, 1)])
    assert n == 2 and data == bytes(block_data(60, 0).numpy()) + bytes(block_data(60, 1).numpy())
    _assert_store_clean(c)


def test_a_flipped_byte_fails_get_bytes_with_data_loss_and_is_dropped(small_store):
    c = LocalClient(small_store.address)
    c.put(62, [0, 1])
    _flip(small_store.address, c.client.profile, block_hash(62, 1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        c.call(StoreClient.get_bytes, [block_hash(62, 0), block_hash(62, 1)])
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "failed their checksum" in err.value.details()
    n, _, data = c.call(StoreClient.get_bytes, [block_hash(62, 0), block_hash(62, 1)])
    assert n == 1 and data == bytes(block_data(62, 0).numpy())  # the bad one is gone, the good one served
    assert c.stats().corrupt_blocks == 1
    _assert_store_clean(c)


def _flip(store_address: str, profile, key: bytes, at: int = 100) -> None:
    """Flip one byte of a stored block through the transfer engine, as a stray writer would."""
    import asyncio

    client = StoreClient(store_address, profile, transfer())
    local = torch.zeros(profile.layout.block_nbytes, dtype=torch.uint8)
    transfer().register(local)

    async def go():
        try:
            pinned = await client.pin([key])
            assert len(pinned.slots) == 1
            remote = pinned.slots.addresses[0]
            await asyncio.to_thread(transfer().read, client.segment, [Span(local.data_ptr(), remote, len(local))])
            local[at] ^= 0xFF
            await asyncio.to_thread(transfer().write, client.segment, [Span(local.data_ptr(), remote, len(local))])
            await client.release(pinned.lease_id)
        finally:
            await client.close()

    try:
        asyncio.run(go())
    finally:
        transfer().unregister(local)


B = 16


@pytest.fixture(scope="module")
def engine(tiny):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(tiny, EngineConfig(num_blocks=512))


@pytest.fixture
def stack(shared_redis_url):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(num_prefill=2, num_decode=2)
    yield s
    s.stop()


def test_a_corrupt_store_block_is_recomputed_by_prefill_and_refused_by_decode(stack, engine):
    """The prefill path: a prefill that reuses the store's blocks finds the flipped one, drops it
    and recomputes from there: exact tokens. The handoff path: a decode pulling it fails the
    request with DATA_LOSS, and the next request recomputes it: exact tokens again."""
    info = run(_info(stack.store.address))
    profile = profile_from_pb(info.profile)
    ids = prompt(4 * B + 3, salt=70)
    tokens, first, _ = run(run_one(stack, "int-a", ids, prefill_index=0))
    assert tokens == expected(engine, ids)
    hashes = list(first.response.block_hashes)

    # Prefill 1 has none of it: it loads the store's blocks, block 1 fails, the rest is recomputed.
    _flip(stack.store.address, profile, hashes[1])
    longer = ids + prompt(B, salt=71)
    tokens, first, _ = run(run_one(stack, "int-b", longer, prefill_index=1))
    assert tokens == expected(engine, longer)
    assert (first.response.usage.cached_tokens_store, first.response.usage.computed_tokens) == (B, len(longer) - B)
    assert run(store_stats(stack.store.address)).corrupt_blocks == 1

    # Decode 1 has none of it: it pulls block 2, which fails; the request fails DATA_LOSS.
    _flip(stack.store.address, profile, hashes[2])
    with pytest.raises(DispatchError) as err:
        run(run_one(stack, "int-c", ids, prefill_index=0, decode_index=1))
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "fail their checksum" in str(err.value)
    assert run(store_stats(stack.store.address)).corrupt_blocks == 2
    tokens, _, _ = run(run_one(stack, "int-d", ids, prefill_index=1, decode_index=1))
    assert tokens == expected(engine, ids)

    def clean() -> bool:
        s = run(store_stats(stack.store.address))
        return s.active_leases == 0 and s.watchers == 0 and all(t.pinned_blocks == 0 for t in s.tiers)

    wait_for(clean, 6.0)


async def _info(address: str):
    from pdserve.v1 import kvstore_pb2
    from tests.support.stack import stubs

    channel, stub = stubs(address, "kvstore")
    async with channel:
        return await stub.Info(kvstore_pb2.InfoRequest(), timeout=5)


def test_the_kvstore_bench_checks_each_span_its_timed_reads_land():
    """`bench kvstore` times a raw read with each landed span verified, as the store's client
    does; the check runs in the transfer's thread, so it must be a plain function (a coroutine
    there would be dropped unrun, and the figure would time no check at all)."""
    from pdserve.bench.kvstore_bench import _verify
    from pdserve.kv.checksum import checksums_at

    nbytes = 1024
    buf = torch.randint(0, 256, (4 * nbytes,), dtype=torch.uint8)
    base = buf.data_ptr()
    sums = checksums_at([base + i * nbytes for i in range(4)], nbytes)
    assert _verify(Span(base + nbytes, 0, 2 * nbytes), base, nbytes, sums) is None  # blocks 1 and 2
    sums[2] ^= 1
    with pytest.raises(RuntimeError, match="failed their checksum"):
        _verify(Span(base + nbytes, 0, 2 * nbytes), base, nbytes, sums)
    _verify(Span(base + 3 * nbytes, 0, nbytes), base, nbytes, sums)  # block 3 alone is still good
