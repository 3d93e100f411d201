"""The cluster tier below DRAM: two store processes sharing one real mooncake_master.

Blocks leaving one node's DRAM are written to the Mooncake Store cluster; a get on another node
whose chain runs past its local tiers fetches them, verified against their first writer's
checksum. A corrupt object is never served; a master that is down costs misses, never errors.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

from pdserve.kv.checksum import checksum_of
from pdserve.kv.hashing import root_hash
from pdserve.kvclient.store_client import StoreClient
from pdserve.runtime.launch import MooncakeMaster
from services.kvstore.cluster import blocks_held, object_key, object_nbytes, segment_bytes_holding, write_trailer
from tests.kv_peer import PROFILE, block_data, block_hash
from tests.kvstore_support import BLOCK, LocalClient, peer, start_store, tier_stats, wait_for
from tests.support.procs import listening

SEGMENT = 16 << 20  # Mooncake's least


def _store(redis_url, key_prefix, master: MooncakeMaster, segment: int = SEGMENT, blocks: int = 2):
    return start_store(redis_url, key_prefix, device_blocks=blocks, dram_blocks=blocks,
                       extra=("--cluster-store", "mooncake", "--cluster-master", master.address,
                              "--cluster-segment-bytes", str(segment), "--cluster-buffer-bytes",
                              str(16 * object_nbytes(BLOCK)), "--cluster-timeout-ms", "1000"))


@pytest.fixture
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


def wait_for_value(fn, want, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while fn() != want:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _cluster(client: LocalClient):
    return client.stats().cluster


def _assert_no_leaks(*clients: LocalClient) -> None:
    for client in clients:
        stats = client.stats()
        assert stats.active_leases == 0 and sum(t.pinned_blocks for t in stats.tiers) == 0


def _raw_client(master: MooncakeMaster):
    """A Mooncake store client of the test's own: it writes objects as no pdserve node would."""
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", SEGMENT, 16 << 20, "tcp", "", master.address) == 0
    return raw


def _get(client: LocalClient, seed: int, indices: list[int]) -> tuple[int, list[bool]]:
    """(blocks read, whether each read block's bytes are exactly the written ones)."""
    hashes = [block_hash(seed, i) for i in indices]
    got = client.call(StoreClient.get, hashes, [client.buf.addr(j) for j in range(len(indices))])
    return got.num_blocks, [torch.equal(client.buf.block(j), block_data(seed, i))
                            for j, i in enumerate(indices[: got.num_blocks])]


def test_a_segment_sized_for_n_blocks_holds_exactly_n():
    """Objects are larger than blocks and the master evicts from 90% full: 64 MiB lent for 1,024
    blocks of 64 KiB holds 867 (the bench's "same capacity" counted 1,024 before S30)."""
    assert blocks_held(1024 * 65536, 65536) == 867
    for nbytes in (BLOCK, 65536, 2 << 20):
        for n in (1, 7, 1024, 2048):
            assert blocks_held(segment_bytes_holding(n, nbytes), nbytes) == n


def test_blocks_leaving_one_node_are_served_by_another_bit_exact(shared_redis_url, key_prefix, master):
    a = _store(shared_redis_url, key_prefix + "a", master)
    b = _store(shared_redis_url, key_prefix + "b", master)
    try:
        ca, cb = LocalClient(a.address), LocalClient(b.address)
        wait_for(lambda: _cluster(ca).connected and _cluster(cb).connected, 30)
        ca.put(1, [0, 1, 2, 3])
        ca.put(1, [4, 5, 6, 7])  # 4 blocks of room: 0-3 leave A's DRAM for the cluster
        wait_for(lambda: _cluster(ca).spilled == 4)
        assert _cluster(ca).put_failures == 0 and _cluster(ca).spill_dropped == 0

        assert _get(cb, 1, [0, 1, 2, 3]) == (4, [True] * 4)  # B never held them
        c = _cluster(cb)
        assert (c.fetched, c.corrupt) == (4, 0)
        assert _get(cb, 1, [0, 1, 2, 3]) == (4, [True] * 4)  # now B's own: no second fetch
        assert _cluster(cb).fetched == 4
        _assert_no_leaks(cb)

        # A chain that goes on past what the cluster holds: the run it holds, then a miss.
        assert _get(cb, 1, [0, 1, 2, 3, 8, 9]) == (4, [True] * 4)
        assert _cluster(cb).fetch_errors == 0  # 8 was not there: a miss, no error

        # Every port of the nodes (their cluster clients' transfer engines too) and of the master
        # listens on the configured host only (runtime.bind_host).
        for pid in (a.proc.pid, b.proc.pid, master.proc.pid):
            assert {addr for addr, _ in listening(pid)} == {"127.0.0.1"}, listening(pid)
        assert len(listening(a.proc.pid)) >= 5  # gRPC, the store's engine (2), the cluster client's (2)
    finally:
        a.stop()
        b.stop()


def test_only_blocks_no_cache_above_holds_are_written_to_the_cluster(shared_redis_url, key_prefix, master):
    """A copy its writer keeps (a prefill's handoff, offload on) leaves DRAM without a cluster
    write: the writer puts it again when its own cache lets it go. A block fetched from the
    cluster is not written there again either. What the store owns is."""
    a = _store(shared_redis_url, key_prefix + "a", master)
    b = _store(shared_redis_url, key_prefix + "b", master)
    try:
        ca, cb = LocalClient(a.address), LocalClient(b.address)
        wait_for(lambda: _cluster(ca).connected and _cluster(cb).connected, 30)
        ca.put(1, [0, 1, 2, 3], writer_keeps_copy=True)
        ca.put(2, [0, 1, 2, 3])  # the copies leave A (4 slots) first: dropped, not written below
        ca.put(1, [0, 1, 2, 3])  # their writer's cache let them go (an offload): A's own; 2/* leave
        wait_for(lambda: _cluster(ca).spilled >= 4, 10)
        assert _get(cb, 2, [0, 1, 2, 3]) == (4, [True] * 4)  # landed: every earlier spill of A's has
        assert (_cluster(ca).spilled, _cluster(ca).spill_dropped, _cluster(ca).put_failures) == (4, 0, 0)
        assert tier_stats(ca.stats())["dram"]["evictions"] == 8

        ca.put(3, [0, 1, 2, 3])  # 1/* (A's own now) leave A for the cluster
        wait_for(lambda: _cluster(ca).spilled == 8, 10)
        assert _get(cb, 1, [0, 1, 2, 3]) == (4, [True] * 4)  # B fetches them (2/* leave B)
        cb.put(4, [0, 1, 2, 3])  # the fetched 1/* leave B: the cluster has them, no second write
        cb.put(5, [0, 1, 2, 3])  # 4/* (B's own) leave B for the cluster
        wait_for(lambda: _cluster(cb).spilled >= 4, 10)
        assert _get(ca, 4, [0, 1, 2, 3]) == (4, [True] * 4)
        assert (_cluster(cb).fetched, _cluster(cb).spilled) == (8, 4)  # 2/* and 1/*; 4/*
        _assert_no_leaks(ca, cb)
    finally:
        a.stop()
        b.stop()


def test_a_corrupt_cluster_object_is_never_served_and_is_removed(shared_redis_url, key_prefix, master):
    b = _store(shared_redis_url, key_prefix, master)
    raw = _raw_client(master)
    try:
        cb = LocalClient(b.address)
        wait_for(lambda: _cluster(cb).connected, 30)
        # Block (2, 0) as a writer would store it, with one byte flipped after the checksum.
        good = block_data(2, 0)
        obj = torch.zeros(object_nbytes(BLOCK), dtype=torch.uint8)
        obj[:BLOCK] = good
        write_trailer(obj.data_ptr(), BLOCK, block_hash(2, 0), checksum_of(good))
        obj[100] ^= 1
        assert raw.register_buffer(obj.data_ptr(), obj.numel()) == 0
        key = object_key(root_hash(PROFILE), block_hash(2, 0))
        assert raw.batch_put_from([key], [obj.data_ptr()], [obj.numel()]) == [0]

        assert _get(cb, 2, [0, 1]) == (0, [])
        c = _cluster(cb)
        assert (c.fetched, c.corrupt) == (0, 1)
        assert raw.batch_is_exist([key]) == [0]  # removed from the cluster: nobody fetches it again
        stats = cb.stats()
        assert stats.active_leases == 0 and stats.tier("device").used_blocks == 0
    finally:
        raw.close()
        b.stop()


def test_with_the_master_gone_the_local_tiers_serve_and_the_tier_comes_back(shared_redis_url, key_prefix,
                                                                            master):
    b = _store(shared_redis_url, key_prefix, master, segment=0)  # B only uses the cluster
    a = _store(shared_redis_url, key_prefix + "a", master)  # A gives it memory
    try:
        ca, cb = LocalClient(a.address), LocalClient(b.address)
        wait_for(lambda: _cluster(ca).connected and _cluster(cb).connected, 30)
        master.kill()
        t0 = time.monotonic()
        assert _get(cb, 3, [0, 1]) == (0, [])  # a miss, at once, not an error
        assert time.monotonic() - t0 < 1.5
        cb.put(3, [0, 1])
        assert _get(cb, 3, [0, 1]) == (2, [True, True])  # local tiers unaffected
        cb.put(3, [2, 3])
        cb.put(3, [4, 5])  # 0, 1 leave DRAM: the write fails (counted), the put does not
        wait_for(lambda: _cluster(cb).put_failures + _cluster(cb).spill_dropped >= 2, 30)
        t0 = time.monotonic()
        assert _get(cb, 3, [6, 7]) == (0, [])  # still a miss at once, however the writes fare
        assert time.monotonic() - t0 < 1.5

        # A restarted master is empty: nodes mount their segments again by themselves. Until
        # they have, writes fail (counted) and the blocks are dropped: the tier is a cache.
        restarted = MooncakeMaster(port=master.port).start()
        try:
            t_up = time.monotonic()
            for seed in range(4, 60):
                ca.put(seed, [0, 1, 2, 3])
                ca.put(seed, [4, 5, 6, 7])  # 0-3 leave A: written, or dropped while A is not mounted
                if wait_for_value(lambda s=seed: _get(cb, s, [0, 1, 2, 3]), (4, [True] * 4), 1.0):
                    break
            else:
                pytest.fail("the cluster tier did not come back")
            assert time.monotonic() - t_up < 15
            assert _cluster(ca).spilled >= 4
        finally:
            restarted.stop()
    finally:
        a.stop()
        b.stop()


def test_two_hash_profiles_sharing_one_master_never_read_each_others_blocks(master):
    """Two tiers of two block sizes (two hash profiles) on one real master, in a process of their
    own (a Mooncake client in the test process would outlive the test beside its transfer
    engine): the same block hash is two keys; each reads back only its own bytes, the other misses."""
    assert _alone(_two_profiles, master).endswith("two profiles: ok")


def _alone(fn, master: MooncakeMaster) -> str:
    """Runs `fn(master address)`, a test module's function, in a process of its own (a Mooncake
    client in the test process would outlive the test beside its transfer engine); returns its stdout."""
    import subprocess
    import sys

    from tests.support.procs import ROOT

    out = subprocess.run([sys.executable, "-c", f"import sys; from {fn.__module__} import {fn.__name__}; "
                          f"{fn.__name__}(sys.argv[1])", master.address], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.strip()


def _two_profiles(master_address: str) -> None:
    import asyncio

    from services.kvstore.cluster import ClusterConfig, ClusterTier

    small = replace(PROFILE, layout=replace(PROFILE.layout, block_size=8))
    tiers = {}
    for name, profile in (("16", PROFILE), ("8", small)):
        nbytes = profile.layout.block_nbytes
        tiers[name] = ClusterTier(ClusterConfig(master_address, segment_bytes=SEGMENT if name == "16" else 0,
                                                buffer_bytes=8 * object_nbytes(nbytes), timeout_s=2.0),
                                  root_hash(profile), nbytes)
    try:
        assert wait_for_value(lambda: all(t.connected for t in tiers.values()), True, 30)
        h = block_hash(9, 0)
        assert tiers["16"].key(h) != tiers["8"].key(h)
        data = block_data(9, 0)
        tiers["16"].spill(h, checksum_of(data), data)
        assert wait_for_value(lambda: tiers["16"].counters.spilled, 1, 10)

        async def fetch(tier):
            run = await tier.fetch([h])
            out = [(f.key, torch.equal(f.view, data)) for f in run]
            tier.done_with(run)
            return out

        assert asyncio.run(fetch(tiers["8"])) == []  # the other profile's key: not there
        assert tiers["8"].counters.fetch_misses == 1
        assert asyncio.run(fetch(tiers["16"])) == [(h, True)]
        print("two profiles: ok", flush=True)
    finally:
        for t in tiers.values():
            t.close()
    # This process's end: without the interpreter's teardown, where destroying two Mooncake store
    # clients in one process now and then aborts ("terminate called without an active exception").
    os._exit(0)


def test_a_node_killed_takes_its_segment_with_it_and_readers_miss_never_read_wrong(shared_redis_url, key_prefix,
                                                                                  master):
    """A lends the cluster its memory (the only segment), B only uses it. A killed (SIGKILL):
    B's reads of what lived in A's segment miss within the tier's timeout (in 26 ms when tried:
    the peer refuses at once), and B's own tiers serve on; B holds no lease or pin afterwards."""
    import signal

    a = _store(shared_redis_url, key_prefix + "a", master)
    b = _store(shared_redis_url, key_prefix + "b", master, segment=0)
    try:
        ca, cb = LocalClient(a.address), LocalClient(b.address)
        wait_for(lambda: _cluster(ca).connected and _cluster(cb).connected, 30)
        # A is written by a peer process: this one's transfer engine must hold no session to a
        # process that is then killed (its port may be another store's later).
        peer("put", a.address, "--seed", "5", "--start", "0", "--n", "4")
        peer("put", a.address, "--seed", "5", "--start", "4", "--n", "4")  # 0-3 leave A's DRAM for A's segment
        wait_for(lambda: _cluster(ca).spilled == 4)
        assert _get(cb, 5, [0, 1]) == (2, [True, True])  # there while A lives
        a.signal(signal.SIGKILL)
        a.proc.wait(10)
        t0 = time.monotonic()
        n, exact = _get(cb, 5, [2, 3])
        assert time.monotonic() - t0 < 3.0  # the tier's timeout (1 s) bounds it
        assert (n, exact) == (0, [])  # a miss (its memory went with it), not an error
        c = _cluster(cb)
        assert (c.fetched, c.corrupt) == (2, 0) and c.fetch_misses + c.fetch_timeouts >= 1
        # Not "not there": the master still lists them, their segment is gone. The read fails
        # (counted and logged as an error) or outlives the tier's timeout.
        assert (c.fetch_errors, c.fetch_timeouts) in ((1, 0), (0, 1)), c
        assert _get(cb, 5, [0, 1]) == (2, [True, True])  # fetched before: B's own now
        cb.put(6, [0, 1])
        assert _get(cb, 6, [0, 1]) == (2, [True, True])
        _assert_no_leaks(cb)
    finally:
        a.stop()
        b.stop()


def test_a_full_cluster_drops_blocks_counted_and_never_stalls_a_put_or_a_get(shared_redis_url, key_prefix, master):
    """One 16 MiB segment (about 250 of these blocks) offered 396: every put is answered, every
    block that left DRAM is accounted for (written, refused or dropped), and what a reader gets
    is the written bytes or a miss."""
    a = _store(shared_redis_url, key_prefix + "a", master)
    b = _store(shared_redis_url, key_prefix + "b", master, segment=0)
    try:
        ca, cb = LocalClient(a.address), LocalClient(b.address)
        wait_for(lambda: _cluster(ca).connected and _cluster(cb).connected, 30)
        seeds = range(100, 200)
        for seed in seeds:
            ca.put(seed, [0, 1, 2, 3])  # 4 blocks of room: each put sends the one before to the cluster
        left = 4 * (len(seeds) - 1)

        def accounted() -> int:
            c = _cluster(ca)
            return c.spilled + c.put_failures + c.spill_dropped

        assert wait_for_value(accounted, left, 60), _cluster(ca)
        read = 0
        for seed in seeds[:-1]:
            n, exact = _get(cb, seed, [0, 1, 2, 3])
            assert exact == [True] * n, seed
            read += n
        assert read > 0  # the most recent ones at least
        assert _cluster(cb).corrupt == 0 and _cluster(cb).fetched == read
        _assert_no_leaks(ca, cb)
    finally:
        a.stop()
        b.stop()


def test_a_filling_segment_refuses_no_put_and_keeps_the_newest_blocks(master):
    """Spills at a steady rate into one segment until it has turned over three times: the master
    evicts the oldest, refuses none (objects padded to OBJECT_ALIGN: 64 KiB + 8-byte objects had
    8-9% of such puts refused, losing newest blocks), and the newest ones all read back."""
    assert _alone(_fill, master).endswith("fill: ok")


def _fill(master_address: str) -> None:
    import asyncio

    from services.kvstore.cluster import ClusterConfig, ClusterTier

    tier = ClusterTier(ClusterConfig(master_address, segment_bytes=SEGMENT, buffer_bytes=64 * object_nbytes(BLOCK),
                                     timeout_s=2.0), root_hash(PROFILE), BLOCK)
    try:
        assert wait_for_value(lambda: tier.connected, True, 30)
        n = 3 * SEGMENT // tier.stride
        data = block_data(3, 0)
        hashes = [block_hash(3, i) for i in range(n)]
        for i, h in enumerate(hashes):
            tier.spill(h, checksum_of(data), data)
            if i % 8 == 7:
                time.sleep(0.01)  # about 800 blocks a second
        c = tier.counters
        assert wait_for_value(lambda: c.spilled + c.put_failures + c.spill_dropped, n, 60)
        assert (c.spilled, c.put_failures, c.spill_dropped) == (n, 0, 0)

        async def newest():
            run = await tier.fetch(hashes[-16:])
            out = [(f.key, torch.equal(f.view, data)) for f in run]
            tier.done_with(run)
            return out

        assert asyncio.run(newest()) == [(h, True) for h in hashes[-16:]]
        print("fill: ok", flush=True)
    finally:
        tier.close()
    os._exit(0)  # (as _two_profiles: no Mooncake client teardown)
