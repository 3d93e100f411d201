"""The KV store over real gRPC, the real Mooncake Transfer Engine and real Redis, in separate processes."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import redis

from pdserve.cluster.keys import RedisKeys
from pdserve.kv.checksum import checksum_at
from pdserve.kvclient.store_client import StoreClient
from pdserve.v1 import kvstore_pb2 as pb
from tests.kv_peer import block_data, block_hash
from tests.kvstore_support import (
    BLOCK,
    LocalClient,
    peer,
    spawn_peer,
    start_store,
    tier_stats,
    tiers_in_redis,
    wait_for,
    wait_ready,
)


@pytest.mark.parametrize("n", [1, 5, 300])
def test_write_then_read_across_processes_bit_exact(shared_redis_url, key_prefix, n):
    """Written by a peer process, read back by this one (another process, its own transfer engine)."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=128, dram_blocks=512)
    try:
        put = peer("put", store.address, "--seed", "11", "--n", str(n), "--tail")
        assert put == {"written": n + 1, "present": 0, "pending": 0, "slices": 1 if n + 1 <= 128 else 2}
        c = LocalClient(store.address)
        assert c.get(11, n, tail=True) == {"num_blocks": n, "has_tail": True, "ok": True,
                                           "slices": 1 if n + 1 <= 128 else 2, "corrupt": 0}
        tiers = tier_stats(c.stats())
        # The tail was allocated last and is gone once read (a per-request block is read once).
        assert tiers["device"]["used"] == min(n, 128) and tiers["dram"]["used"] == max(0, n - 128)
        assert c.get(11, n, tail=True)["has_tail"] is False
        again = c.put(11, list(range(n)))
        assert (again.written, again.present, again.pending, again.slices) == (0, n, 0, 0)
    finally:
        store.stop()


def test_eviction_demotion_and_promotion_order(small_store, shared_redis_url, key_prefix):
    c = LocalClient(small_store.address)
    c.put(1, [0, 1, 2, 3])  # device: 0 1 2 3
    c.put(1, [4, 5])  # device LRU 0, 1 demote to DRAM
    want = {0: "dram", 1: "dram", 2: "device", 3: "device", 4: "device", 5: "device"}
    assert tiers_in_redis(shared_redis_url, key_prefix, 1, list(want), expect=want) == want
    c.put(1, [6, 7, 8])  # device LRU 2, 3, 4 demote; DRAM: 0 1 2 3 full -> 0 dropped for 4
    want = {0: None, 1: "dram", 2: "dram", 3: "dram", 4: "dram", 5: "device", 6: "device", 7: "device", 8: "device"}
    assert tiers_in_redis(shared_redis_url, key_prefix, 1, list(want), expect=want) == want
    # A DRAM hit is served from DRAM, then promoted when released; device LRU (5) demotes in its place.
    got = c.call(StoreClient.get, [block_hash(1, 1)], [c.buf.addr(0)])
    assert got.num_blocks == 1 and c.buf.block(0).equal(block_data(1, 1))
    want = {1: "device", 5: "dram", 6: "device", 2: "dram"}
    assert tiers_in_redis(shared_redis_url, key_prefix, 1, list(want), expect=want) == want
    s = c.stats()
    assert tier_stats(s) == {"device": {"used": 4, "pinned": 0, "evictions": 6},
                             "dram": {"used": 4, "pinned": 0, "evictions": 1}}
    assert [t.promotions for t in s.tiers] == [1, 0] and s.hits == 1


@pytest.mark.parametrize("dram_blocks, spill, in_dram, dram_evictions", [
    (2, 0, [2, 3], 2),  # DRAM turns over while the device makes room: 0, 1 demoted, then dropped
    (4, 2, [2, 3], 2),  # the put's own spill into DRAM drops 0, 1 after they were demoted
    (8, 2, [0, 1, 2, 3], 0),  # room for all: every demoted block is copied
])
def test_demotions_of_one_put_land_bit_exact(shared_redis_url, key_prefix, dram_blocks, spill, in_dram,
                                            dram_evictions):
    """A put that makes room demotes the device's blocks in one batch of copies, after deciding
    where each ends: a block demoted and then dropped within the same put is never copied, and
    every block that stays reads back bit-exact from its tier."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=dram_blocks)
    try:
        c = LocalClient(store.address)
        c.put(1, [0, 1, 2, 3])
        c.put(2, list(range(4 + spill)))
        want = {i: "dram" if i in in_dram else None for i in range(4)}
        assert tiers_in_redis(shared_redis_url, key_prefix, 1, list(want), expect=want) == want
        assert tier_stats(c.stats()) == {"device": {"used": 4, "pinned": 0, "evictions": 4},
                                         "dram": {"used": len(in_dram) + spill, "pinned": 0,
                                                  "evictions": dram_evictions}}
        for seed, indices in ((1, in_dram), (2, list(range(4 + spill)))):
            got = c.call(StoreClient.get, [block_hash(seed, i) for i in indices],
                         [c.buf.addr(j) for j in range(len(indices))])
            assert got.num_blocks == len(indices)
            assert [c.buf.block(j).equal(block_data(seed, i)) for j, i in enumerate(indices)] == [True] * len(indices)
    finally:
        store.stop()


@pytest.mark.parametrize("offloaded_later", [False, True])
def test_copies_their_writer_keeps_are_evicted_first(shared_redis_url, key_prefix, offloaded_later):
    """Handoff copies (writer_keeps_copy) go to the cold end of the LRU once unpinned; an offload
    of the same blocks (a plain put) makes them the most recent again."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4, lease_ms=1000)
    try:
        c = LocalClient(store.address)
        c.put(1, [0, 1, 2, 3])  # device: A0 A1 A2 A3
        c.put(2, [0, 1], writer_keeps_copy=True)  # A0 A1 demote to DRAM; device, coldest first: D1 D0 A2 A3
        if offloaded_later:
            assert c.put(2, [0, 1]).present == 2  # nothing to write: just kept, most recent now
        c.put(1, [4, 5, 6, 7])  # two blocks must leave the store
        if offloaded_later:
            want = {(1, 0): None, (1, 1): None, (2, 0): "dram", (2, 1): "dram"}
        else:
            want = {(1, 0): "dram", (1, 1): "dram", (2, 0): None, (2, 1): None}
        got = {(seed, i): tiers_in_redis(shared_redis_url, key_prefix, seed, [i], expect={i: tier})[i]
               for (seed, i), tier in want.items()}
        assert got == want
        rest = {2: "dram", 3: "dram", 4: "device", 5: "device", 6: "device", 7: "device"}
        assert tiers_in_redis(shared_redis_url, key_prefix, 1, list(rest), expect=rest) == rest
    finally:
        store.stop()


def test_making_room_never_evicts_blocks_of_the_same_put(small_store, shared_redis_url, key_prefix):
    c = LocalClient(small_store.address)
    c.put(1, [0, 1, 2, 3])
    c.put(1, [4, 5, 6, 7])  # full: 0 1 2 3 demoted to DRAM, 0 its least recently used
    put = c.put(1, [0, 8])  # 8 takes 4's device slot, 4 needs DRAM room: 0 is in this put, so 1 goes
    assert (put.written, put.present) == (1, 1)
    want = {0: "dram", 1: None, 4: "dram", 8: "device"}
    assert tiers_in_redis(shared_redis_url, key_prefix, 1, list(want), expect=want) == want


def test_a_handoff_hold_pins_its_blocks_until_released_or_lapsed(small_store):
    """hold_ms > 0: the blocks present or written by the put stay pinned for their reader under a
    hold lease, until it is released, the writer fails (releases its write lease uncommitted), or
    it lapses hold_ms after the last commit."""
    c = LocalClient(small_store.address)
    c.put(1, [0, 1])
    pinned = lambda: (tier_stats(c.stats())["device"]["pinned"], c.stats().active_leases)  # noqa: E731
    alloc = c.call(StoreClient.allocate, [block_hash(1, i) for i in range(4)], "", "h1", 0, True, 5000)
    assert alloc.slots.states == [pb.SLOT_STATE_PRESENT] * 2 + [pb.SLOT_STATE_WRITE] * 2
    assert alloc.hold_lease_id and pinned() == (4, 2)  # the hold's 4, the writer's 2 of them
    for j in range(4):
        c.buf.block(j).copy_(block_data(1, j))
    c.call(StoreClient.ship, alloc, 0, 4, [c.buf.addr(j) for j in range(4)])
    assert pinned() == (4, 1)
    # The device is full and all of it held: a new put spills to DRAM, evicting nothing here.
    c.put(2, [0])
    assert tier_stats(c.stats())["device"] == {"used": 4, "pinned": 4, "evictions": 0}
    assert c.call(StoreClient.release, alloc.hold_lease_id).unpinned == 4
    assert pinned() == (0, 0)
    # A writer that fails takes its hold with it.
    failed = c.call(StoreClient.allocate, [block_hash(3, 0), block_hash(1, 0)], "", "h2", 0, True, 5000)
    assert pinned() == (2, 2)
    assert c.call(StoreClient.release, failed.lease_id).reclaimed == 1  # fenced, then free
    assert pinned() == (0, 0)
    wait_for(lambda: c.stats().fenced_blocks == 0, 3.0)
    # Nobody releases it: it lapses hold_ms after the last commit.
    lapsing = c.call(StoreClient.allocate, [block_hash(1, 0)], "", "h3", 0, True, 300)
    assert lapsing.hold_lease_id and pinned() == (1, 1)
    time.sleep(0.7)
    assert pinned() == (0, 0)


def test_pinned_blocks_survive_and_full_store_refuses(small_store):
    c = LocalClient(small_store.address)
    c.put(2, [0, 1, 2, 3])
    holder_a = spawn_peer("hold-get", small_store.address, "--seed", "2", "--n", "4")
    holder_b = None
    try:
        wait_ready(holder_a)
        c.put(3, [0, 1, 2, 3])  # device all pinned: spills into DRAM, nothing evicted
        holder_b = spawn_peer("hold-get", small_store.address, "--seed", "3", "--n", "4")
        wait_ready(holder_b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            c.put(4, [0])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "store full" in err.value.details()
        s = tier_stats(c.stats())
        full = {"used": 4, "pinned": 4, "evictions": 0}
        assert s == {"device": full, "dram": full}
        assert c.get(2, 4) == {"num_blocks": 4, "has_tail": False, "ok": True, "slices": 1, "corrupt": 0}
    finally:
        for h in (holder_a, holder_b):
            if h:
                h.kill()
                h.wait()


def test_killed_reader_and_writer_leases_lapse(small_store):
    c = LocalClient(small_store.address)
    c.put(5, [0, 1])
    reader = spawn_peer("hold-get", small_store.address, "--seed", "5", "--n", "2")
    writer = spawn_peer("hold-put", small_store.address, "--seed", "6", "--n", "1", "--tail")
    wait_ready(reader)
    wait_ready(writer)
    s = c.stats()
    assert s.active_leases == 2 and tier_stats(s)["device"] == {"used": 4, "pinned": 4, "evictions": 0}
    reader.send_signal(signal.SIGKILL)
    writer.send_signal(signal.SIGKILL)
    reader.wait()
    writer.wait()
    # Lease TTL is 1 s here: within TTL + 2 s everything is back to baseline (2 committed, unpinned).
    # The writer's uncommitted slots are fenced a while (300 ms here), then free too.
    elapsed = wait_for(lambda: c.stats().active_leases == 0 and c.stats().fenced_blocks == 0, 3.5)
    assert elapsed < 3.5
    assert tier_stats(c.stats())["device"] == {"used": 2, "pinned": 0, "evictions": 0}
    assert c.get(6, 1) == {"num_blocks": 0, "has_tail": False, "ok": True, "slices": 0, "corrupt": 0}


def test_two_writers_of_the_same_blocks(shared_redis_url, key_prefix):
    store = start_store(shared_redis_url, key_prefix, device_blocks=64, dram_blocks=64)
    try:
        procs = [spawn_peer("put", store.address, "--seed", "9", "--n", "20") for _ in range(2)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-2000:]
            results.append(__import__("json").loads(out.strip().splitlines()[-1]))
        assert sum(r["written"] for r in results) == 20  # one copy of each block
        c = LocalClient(store.address)
        assert tier_stats(c.stats())["device"]["used"] == 20
        assert c.get(9, 20) == {"num_blocks": 20, "has_tail": False, "ok": True, "slices": 1, "corrupt": 0}
    finally:
        store.stop()


def test_watch_is_told_of_each_commit(small_store):
    c = LocalClient(small_store.address)
    seed, n = 12, 3
    hashes = [block_hash(seed, i) for i in range(n)]
    for i in range(n):
        c.buf.block(i).copy_(block_data(seed, i))

    async def scenario(client: StoreClient):
        events: list[int] = []
        watch = client.watch(hashes, timeout_s=10)
        first = asyncio.ensure_future(anext(watch))
        alloc = await client.allocate(hashes)
        for i in range(n):
            await asyncio.sleep(0.2)
            assert len(events) == i  # nothing arrives before its commit
            await client.write(alloc.slots[i : i + 1], [c.buf.addr(i)])
            await client.commit(alloc.lease_id, [hashes[i]], [checksum_at(c.buf.addr(i), BLOCK)])
            ev = await asyncio.wait_for(first if i == 0 else anext(watch), 5)
            events.extend(ev.indices)
            assert ev.slots.checksums == [checksum_at(c.buf.addr(j), BLOCK) for j in ev.indices]
            assert await client.read_slots(ev.slots, [c.buf.addr(32 + j) for j in ev.indices]) == []
            assert all(c.buf.block(32 + j).equal(block_data(seed, j)) for j in ev.indices)
        stats = await client.stats()
        with pytest.raises(StopAsyncIteration):  # all delivered: the iteration ends, and its lease with it
            await anext(watch)
        return events, stats, ev.lease_id

    events, stats, lease_id = c.call(scenario)
    assert events == [0, 1, 2]
    assert stats.watchers == 0 and stats.active_leases == 1 and tier_stats(stats)["device"]["pinned"] == 3
    wait_for(lambda: c.stats().active_leases == 0)
    after = c.stats()
    assert tier_stats(after)["device"]["pinned"] == 0 and "ReleaseLease" not in after.calls
    with pytest.raises(grpc.aio.AioRpcError) as e:
        c.call(StoreClient.release, lease_id)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ended with its watch" in e.value.details()


def test_a_watch_the_client_never_ends_ends_at_its_deadline(small_store):
    """Every block delivered, the stream stays open for the reader; a client that neither reads
    on nor cancels holds its lease only to the call's deadline."""
    c = LocalClient(small_store.address)
    c.put(16, [0])

    async def scenario(client: StoreClient):
        stub = await client._stub_ready()
        call = stub.Watch(pb.WatchRequest(profile=client.profile_pb, block_hashes=block_hash(16, 0)),
                          timeout=1.0, metadata=client._metadata)
        event = await call.read()
        held = await client.stats()
        code = await call.code()  # (not read on, not cancelled: the deadline ends it)
        await asyncio.sleep(0.2)
        return event, held, code, await client.stats()

    event, held, code, after = c.call(scenario)
    assert list(event.indices) == [0] and held.active_leases == 1 and tier_stats(held)["device"]["pinned"] == 1
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after.active_leases == 0 and tier_stats(after)["device"]["pinned"] == 0


def test_releases_of_one_moment_travel_in_one_call(small_store):
    """release_soon coalesces: three read leases end in one ReleaseLease call. A batch lists what
    it could not end (unknown, another client's) and ends the rest."""
    c = LocalClient(small_store.address)
    c.put(14, [0, 1])
    hashes = [block_hash(14, 0), block_hash(14, 1)]

    async def scenario(client: StoreClient):
        stranger = StoreClient(client.target, client.profile)  # another client id
        other = await stranger.pin(hashes)
        leases = [(await client.pin(hashes[: 1 + i % 2])).lease_id for i in range(3)]
        before = (await client.stats()).calls.get("ReleaseLease", 0)
        for lease in leases:
            client.release_soon(lease)
        await client._releases.drain()
        mid = await client.stats()
        batch = await client._call("ReleaseLease", pb.ReleaseLeaseRequest(
            lease_ids=[leases[0], "0" * 32, other.lease_id]))
        await stranger.release(other.lease_id)
        await stranger.close()
        return leases[0], other, before, mid, batch

    first, other, before, mid, batch = c.call(scenario)
    assert mid.calls["ReleaseLease"] == before + 1
    assert mid.active_leases == 1 and tier_stats(mid)["device"]["pinned"] == 2  # the other client's lease alone
    assert [(r.lease_id, r.code) for r in batch.refused] == [
        (first, "FAILED_PRECONDITION"), ("0" * 32, "NOT_FOUND"), (other.lease_id, "PERMISSION_DENIED")]
    assert batch.unpinned == 0 and c.stats().active_leases == 0


def test_stats_count_the_calls_taken(small_store):
    c = LocalClient(small_store.address)
    c.put(15, [0])
    calls = c.stats().calls
    assert (calls["AllocatePut"], calls["CommitPut"], calls["Stats"]) == (1, 1, 1) and "Get" not in calls


def test_watch_cancelled_releases_its_pins(small_store):
    c = LocalClient(small_store.address)
    c.put(13, [0])
    hashes = [block_hash(13, 0), block_hash(13, 1)]

    async def scenario(client: StoreClient):
        watch = client.watch(hashes, timeout_s=10)
        ev = await anext(watch)
        assert ev.indices == [0]
        await watch.aclose()  # gone before block 1 ever came
        await asyncio.sleep(0.3)
        return await client.stats()

    stats = c.call(scenario)
    assert stats.watchers == 0 and stats.active_leases == 0 and tier_stats(stats)["device"]["pinned"] == 0


def test_bytes_path_and_cross_path(small_store):
    c = LocalClient(small_store.address)
    data = b"".join(bytes(block_data(20, i).numpy()) for i in range(3))
    hashes = [block_hash(20, i) for i in range(3)]
    resp = c.call(StoreClient.put_bytes, hashes, data + bytes(block_data(20, -1).numpy()), tail_key="req-20",
                  tail_lease_ms=5000, chunk_bytes=7000)
    assert resp == (4, 0, 0)
    assert c.get(20, 3, tail=True) == {"num_blocks": 3, "has_tail": True, "ok": True, "slices": 1, "corrupt": 0}
    c.put(21, [0, 1])
    n, has_tail, got = c.call(StoreClient.get_bytes, [block_hash(21, 0), block_hash(21, 1), block_hash(21, 9)])
    assert (n, has_tail) == (2, False) and got == b"".join(bytes(block_data(21, i).numpy()) for i in range(2))
    assert c.stats().active_leases == 0


def test_redis_down_store_serves_and_index_is_rebuilt(private_redis, key_prefix):
    store = start_store(private_redis.url, key_prefix, device_blocks=16, dram_blocks=16)
    try:
        c = LocalClient(store.address)
        c.put(40, [0, 1])
        want = {0: "device", 1: "device"}
        assert tiers_in_redis(private_redis.url, key_prefix, 40, [0, 1], expect=want) == want
        private_redis.stop()
        c.put(40, [2, 3])
        assert c.get(40, 4) == {"num_blocks": 4, "has_tail": False, "ok": True, "slices": 1, "corrupt": 0}
        wait_for(lambda: not c.stats().redis_connected, 5)
        private_redis.start()  # same port, empty
        want = {i: "device" for i in range(4)}
        assert tiers_in_redis(private_redis.url, key_prefix, 40, list(range(4)), timeout_s=10, expect=want) == want
        assert c.stats().redis_connected
        r = redis.Redis.from_url(private_redis.url)
        assert 0 < r.ttl(RedisKeys(key_prefix).store_index()) <= 600
    finally:
        store.stop()
