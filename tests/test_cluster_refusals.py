"""What a cluster fetch refuses or gives up on, against a real mooncake_master and store nodes:
an object that is not the key's block is never served, nor one whose trailer mixes two objects',
and a get waits on the cluster no longer than its caller's deadline allows (nor does a fetch
given up while queued run later).
"""

from __future__ import annotations

import signal
import time

import torch

from pdserve.kv.checksum import checksum_of
from pdserve.kv.hashing import root_hash
from services.kvstore.cluster import object_key, object_nbytes, read_trailer, write_trailer
from tests.kv_peer import PROFILE, block_data, block_hash
from tests.kvstore_support import BLOCK, LocalClient, peer, wait_for
from tests.test_cluster_tier import _alone, _cluster, _get, _raw_client, _store, master, wait_for_value  # noqa: F401


def test_another_blocks_object_under_a_key_is_refused_never_served(shared_redis_url, key_prefix, master):  # noqa: F811
    """A read of K1 outlived the master's 1 s object lease; the master evicted K1 and gave its
    memory to a put of K2 (every object has one size): the reader finds K2's object, whole and
    as its writer stored it, under K1. It is refused (a miss, counted corrupt, removed), never
    served as K1; K2 still reads back under its own key."""
    b = _store(shared_redis_url, key_prefix, master)
    raw = _raw_client(master)
    try:
        cb = LocalClient(b.address)
        wait_for(lambda: _cluster(cb).connected, 30)
        cb.put(7, [0, 1, 2, 3])
        cb.put(8, [0, 1, 2, 3])  # 4 blocks of room: 7/* leave B's DRAM for the cluster
        wait_for(lambda: _cluster(cb).spilled == 4, 10)
        root = root_hash(PROFILE)
        k1, k2 = object_key(root, block_hash(9, 0)), object_key(root, block_hash(7, 1))
        obj = raw.get(k2)
        assert len(obj) == object_nbytes(BLOCK)
        assert raw.put(k1, obj) == 0

        assert _get(cb, 9, [0, 1]) == (0, [])
        c = _cluster(cb)
        assert (c.fetched, c.corrupt) == (0, 1)
        assert raw.batch_is_exist([k1]) == [0]  # removed from the cluster: nobody fetches it again
        assert _get(cb, 9, [0]) == (0, [])  # nor was it stored here under 9/0
        assert _get(cb, 7, [1]) == (1, [True])  # the object itself is sound, under its own key
        c = _cluster(cb)
        assert (c.fetched, c.corrupt) == (1, 1)
        assert cb.stats().active_leases == 0
    finally:
        raw.close()
        b.stop()


def test_a_trailer_torn_between_two_objects_fails_its_seal():
    """A read racing a put into reused memory may mix two objects: K2's bytes and checksum under
    K1's block hash would pass a check of the hash and of the checksum, each alone; the seal over
    the two refuses the mix. Sealed whole, the trailer reads back as written."""
    obj = torch.zeros(object_nbytes(BLOCK), dtype=torch.uint8)
    data = block_data(7, 1)
    obj[:BLOCK] = data
    write_trailer(obj.data_ptr(), BLOCK, block_hash(7, 1), checksum_of(data))
    assert read_trailer(obj.data_ptr(), BLOCK) == (block_hash(7, 1), checksum_of(data))
    obj[BLOCK : BLOCK + 16] = torch.frombuffer(bytearray(block_hash(9, 0)), dtype=torch.uint8)
    assert read_trailer(obj.data_ptr(), BLOCK) is None


def test_a_get_waits_on_the_cluster_no_longer_than_its_callers_deadline(shared_redis_url, key_prefix,
                                                                        master):  # noqa: F811
    """A lends the cluster its segment and stops answering (SIGSTOP: a transfer from it hangs,
    where a dead node's is refused at once). B's get with 0.6 s left, under the tier's 1 s
    timeout, answers a miss before its caller gives up: the cluster costs a miss, never the
    request (a get of many rounds, each under the tier's timeout, overran the worker's 5 s)."""
    a = _store(shared_redis_url, key_prefix + "a", master)
    b = _store(shared_redis_url, key_prefix + "b", master, segment=0)
    try:
        ca, cb = LocalClient(a.address), LocalClient(b.address, timeout_s=0.6)
        wait_for(lambda: _cluster(ca).connected and _cluster(cb).connected, 30)
        peer("put", a.address, "--seed", "5", "--start", "0", "--n", "4")
        peer("put", a.address, "--seed", "5", "--start", "4", "--n", "4")  # 0-3 leave A's DRAM for A's segment
        wait_for(lambda: _cluster(ca).spilled == 4)
        a.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert _get(cb, 5, [0, 1, 2, 3]) == (0, [])
            assert time.monotonic() - t0 < 0.6
            c = _cluster(cb)
            assert (c.fetched, c.fetch_timeouts) == (0, 1), c
        finally:
            a.signal(signal.SIGCONT)
    finally:
        a.stop()
        b.stop()


def test_a_fetch_given_up_while_queued_never_runs(shared_redis_url, key_prefix, master):  # noqa: F811
    """Two fetches at once from a segment whose node stopped answering: the first hangs on the
    read thread, the second waits behind it. Both give up at the tier's timeout; the queued one
    is cancelled (its staging slots free at once, where it would have held them until the hung
    read returned, then run), and gets skip the cluster while the hung one lasts."""
    a = _store(shared_redis_url, key_prefix + "a", master)
    try:
        ca = LocalClient(a.address)
        wait_for(lambda: _cluster(ca).connected, 30)
        peer("put", a.address, "--seed", "5", "--start", "0", "--n", "4")
        peer("put", a.address, "--seed", "5", "--start", "4", "--n", "4")
        wait_for(lambda: _cluster(ca).spilled == 4)
        a.signal(signal.SIGSTOP)
        try:
            assert _alone(_queued, master).endswith("queued: ok")
        finally:
            a.signal(signal.SIGCONT)
    finally:
        a.stop()


def _queued(master_address: str) -> None:
    import asyncio
    import os
    import traceback

    from services.kvstore.cluster import ClusterConfig, ClusterTier

    tier = ClusterTier(ClusterConfig(master_address, buffer_bytes=8 * object_nbytes(BLOCK), timeout_s=0.5),
                       root_hash(PROFILE), BLOCK)
    try:
        assert wait_for_value(lambda: tier.connected, True, 30)
        hashes = [block_hash(5, i) for i in range(4)]  # a fetch takes a quarter of the 8 slots: 2

        async def go():
            assert await asyncio.gather(tier.fetch(hashes), tier.fetch(hashes)) == [[], []]
            assert await tier.fetch(hashes) == []  # at once: the first is still stuck

        asyncio.run(go())
        c = tier.counters
        assert (c.fetch_timeouts, c.unreachable, c.fetched) == (2, 1, 0), c
        assert tier._free.qsize() == 6, tier._free.qsize()  # all but the hung read's 2 slots
        print("queued: ok", flush=True)
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # now: the interpreter's exit would wait for the hung read thread
    finally:
        tier.close()
    os._exit(0)  # (as _two_profiles: no Mooncake client teardown)
