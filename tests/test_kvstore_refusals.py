"""The store's refusals over real gRPC, with the real transfer engine and real Redis, the store
in its own process: bad input, leases that are not the caller's or no longer open. Each gets a
clear status, and the store stays healthy and leaks nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.kv.checksum import checksum_at
from pdserve.kvclient.store_client import StoreClient
from pdserve.v1 import common_pb2
from pdserve.v1 import kvstore_pb2 as pb
from tests.kv_peer import block_hash
from tests.kvstore_support import BLOCK, LocalClient, tier_stats, wait_for


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def test_bad_input_gets_clear_status_and_store_stays_healthy(small_store):
    from tests.support.procs import SERVING, health

    c = LocalClient(small_store.address)
    INVALID = grpc.StatusCode.INVALID_ARGUMENT

    async def alloc(client, **kw):
        return await client._call("AllocatePut", pb.AllocatePutRequest(profile=client.profile_pb, **kw))

    async def wrong_layout(client):
        prof = common_pb2.HashProfile()
        prof.CopyFrom(client.profile_pb)
        prof.layout.block_size = 32
        return await client._call("Get", pb.GetRequest(profile=prof, block_hashes=block_hash(1, 0)))

    async def wrong_model(client):
        prof = common_pb2.HashProfile()
        prof.CopyFrom(client.profile_pb)
        prof.model_fingerprint = "0" * 64
        return await client._call("AllocatePut", pb.AllocatePutRequest(profile=prof, block_hashes=block_hash(1, 0)))

    async def anonymous(client):  # no client id in the metadata
        await client.connect()
        return await client._stub.Get(pb.GetRequest(profile=client.profile_pb, block_hashes=block_hash(1, 0)))

    assert _code(lambda: c.call(wrong_layout)) == (INVALID, "hash profile mismatch: KV layout differs: "
                                                   "L2x2xH2xB32xD64:float32 vs L2x2xH2xB16xD64:float32")
    assert _code(lambda: c.call(wrong_model))[0] == INVALID
    code, msg = _code(lambda: c.call(alloc, block_hashes=block_hash(1, 0) + b"short"))
    assert code == INVALID and "21 bytes is not a whole number of 16-byte hashes (hash 1 has 5 bytes)" in msg
    code, msg = _code(lambda: c.call(alloc, block_hashes=b"".join(block_hash(1, i) for i in range(70_000))))
    assert code == INVALID and "too many blocks in one request: 70000 > 16384" in msg
    code, msg = _code(lambda: c.call(alloc, block_hashes=b"".join(block_hash(1, i) for i in range(9))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "9 blocks requested, 8 can be made free" in msg
    for field in ("lease_ms", "hold_ms"):  # one call may not pin memory for 49 days
        code, msg = _code(lambda field=field: c.call(alloc, block_hashes=block_hash(1, 0), **{field: 2**32 - 1}))
        assert code == INVALID and f"{field} 4294967295 is over this store's maximum 300000" in msg
    code, msg = _code(lambda: c.call(alloc, block_hashes=block_hash(1, 0) * 2))
    assert code == INVALID and "repeat" in msg
    assert _code(lambda: c.call(anonymous)) == (INVALID, "name your client: metadata 'pdserve-client-id' is missing")
    code, msg = _code(lambda: c.call(StoreClient.commit, "0" * 32, [], []))  # a guessed lease id
    assert code == grpc.StatusCode.NOT_FOUND and "is unknown" in msg
    code, msg = _code(lambda: c.call(StoreClient.release, "w2"))  # an old-style sequential one
    assert code == grpc.StatusCode.NOT_FOUND
    code, msg = _code(lambda: c.call(StoreClient.put_bytes, [block_hash(1, 0)], b"x" * (BLOCK - 1)))
    assert code == INVALID and f"got {BLOCK - 1} bytes, expected {BLOCK}" in msg
    alloc_ok = c.call(StoreClient.allocate, [block_hash(1, 0)])
    code, msg = _code(lambda: c.call(StoreClient.commit, alloc_ok.lease_id, [block_hash(1, 5)], [0]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "was never part of it" in msg
    code, msg = _code(lambda: c.call(StoreClient.commit, alloc_ok.lease_id, [block_hash(1, 0)], []))
    assert code == INVALID and "0 checksums for 1 blocks" in msg
    other = LocalClient(small_store.address)  # another client: none of this lease is its to touch
    for call in ((StoreClient.commit, alloc_ok.lease_id, [block_hash(1, 0)], [0]),
                 (StoreClient.release, alloc_ok.lease_id), (StoreClient.renew, alloc_ok.lease_id)):
        code, msg = _code(lambda call=call: other.call(*call))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "belongs to another client" in msg
    c.call(StoreClient.release, alloc_ok.lease_id)

    assert health(small_store.address) == SERVING
    wait_for(lambda: c.stats().fenced_blocks == 0, 3.0)
    s = c.stats()
    assert s.active_leases == 0 and tier_stats(s)["device"] == {"used": 0, "pinned": 0, "evictions": 0}
    c.put(1, [0, 1])
    assert c.get(1, 2) == {"num_blocks": 2, "has_tail": False, "ok": True, "slices": 1, "corrupt": 0}


def test_a_commit_on_a_closed_or_lapsed_lease_is_refused_never_answered_as_done(small_store):
    c = LocalClient(small_store.address)
    hashes = [block_hash(30, 0), block_hash(30, 1)]
    sums = [checksum_at(c.buf.addr(j), BLOCK) for j in range(2)]

    async def scenario(client):
        alloc = await client.allocate(hashes)
        await client.write(alloc.slots, [c.buf.addr(0), c.buf.addr(1)])
        out = [await client.commit(alloc.lease_id, hashes[:1], sums[:1])]
        for commit in ((hashes[:1], sums[:1]), (hashes[1:], sums[1:]), (hashes[1:], sums[1:])):
            try:
                out.append(await client.commit(alloc.lease_id, *commit))
            except grpc.aio.AioRpcError as e:
                out.append((e.code(), e.details().rsplit("' ", 1)[-1]))
        lapsing = await client.allocate([block_hash(31, 0)], lease_ms=200)
        await asyncio.sleep(0.6)
        try:
            await client.commit(lapsing.lease_id, [block_hash(31, 0)], [0])
        except grpc.aio.AioRpcError as e:
            out.append((e.code(), "has lapsed" in e.details()))
        return out

    FAILED = grpc.StatusCode.FAILED_PRECONDITION
    assert c.call(scenario) == [
        (1, False), (FAILED, "is not one it writes, or is committed"), (1, True),
        (FAILED, "has been committed in full: nothing more can be done under it"), (FAILED, True)]
