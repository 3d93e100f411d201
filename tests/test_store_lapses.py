"""Leases that end part-way, in one process (no transport): a handoff's write lease and its hold
lapsing in one reaper pass, a GetBytes or PutBytes stream outliving the lease it would have had,
and a tail found corrupt while its key is put again. Each case once let a pin go twice, served
another block's bytes, answered a put as stored when it was not, or leaked a slot. The servicer
runs with a stand-in for gRPC's context (named as such); the store process tests cover the
same calls end to end."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import FailedPrecondition, ResourceExhausted
from pdserve.kv.checksum import checksum_of
from pdserve.rpc.convert import profile_to_pb
from pdserve.v1 import kvstore_pb2 as pb
from services.kvstore.memory import TierMemory
from services.kvstore.servicer import CLIENT_ID_KEY, KVStoreServicer
from services.kvstore.store import DEVICE, BlockStore
from tests.kv_peer import PROFILE
from tests.test_block_store import _h, _put

NBYTES = PROFILE.layout.block_nbytes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(device: int, dram: int, clock: Clock, nbytes: int = 8) -> BlockStore:
    return BlockStore(TierMemory("device", device, nbytes), TierMemory("dram", dram, nbytes), default_lease_s=1.0,
                      clock=clock, fence_s=5.0)


def _free(store: BlockStore) -> int:
    return sum(t.allocator.num_free for t in store.tiers.values())


def test_a_handoffs_write_lease_and_hold_lapsing_in_one_pass_unpin_its_blocks_once():
    clock = Clock()
    store = _store(4, 0, clock)
    _put(store, [_h(1)])  # stored earlier, unpinned
    b1 = store.blocks.get(_h(1))
    store.allocate_put("w", [_h(1), _h(2)], None, 1000, "r2", hold_ms=1000)  # the writer dies: nothing committed
    assert b1.pins == 1  # the hold's
    clock.now = 2.0
    assert store.reap() == 2  # both lapse in this pass; the write ended its hold first
    assert b1.pins == 0 and store.blocks.order(DEVICE) == [_h(1)]
    lease, got, _ = store.get("x", [_h(1)], None, 0, "r3")
    assert got == [b1] and b1.pins == 1 and store.blocks.order(DEVICE) == []
    with pytest.raises(ResourceExhausted):  # 2 slots free, 1 fenced: the reader's block is not evicted
        store.allocate_put("z", [_h(10), _h(11), _h(12)], None, 0, "z")
    store.release("x", lease.lease_id)
    assert b1.pins == 0 and len(store.leases) == 0


def test_a_corrupt_tail_put_again_under_its_key_frees_the_old_slot():
    clock = Clock()
    store = _store(4, 0, clock)

    def put_tail():
        lease, slots = store.allocate_put("w", [], b"tail:k", 0, "w")
        view = store.blocks.view(slots[0].block)
        view.fill_(3)
        store.commit("w", lease.lease_id, [], [], tail=True, tail_checksum=checksum_of(view), tail_ttl_ms=1000)
        return slots[0].block

    first = put_tail()
    read, _, tail = store.get("r", [], b"tail:k", 5000, "r")
    assert tail is first and first.pins == 2  # its TTL's and the reader's
    store.blocks.view(first)[0] ^= 1
    assert store.report_corrupt("r", read.lease_id, [], True) == 1
    assert first.pins == 1  # the reader's only: a corrupt tail keeps no TTL
    second = put_tail()  # the writer puts it again
    store.release("r", read.lease_id)
    assert first.pins == 0 and second.pins == 1 and _free(store) == 3
    clock.now = 10.0
    store.reap()
    assert second.pins == 0 and _free(store) == 4 and store.blocks.blocks() == []


class Context:
    """Stands in for a gRPC servicer context: the caller's metadata only."""

    def invocation_metadata(self):
        return ((CLIENT_ID_KEY, "me"),)


def _servicer(clock: Clock) -> KVStoreServicer:
    store = _store(2, 0, clock, NBYTES)
    return KVStoreServicer(store, PROFILE, "segment", "host", max_blocks=16)


async def _put_bytes(sv: KVStoreServicer, i: int, value: int, stall=None):
    async def messages():
        yield pb.PutBytesRequest(header=pb.PutBytesHeader(profile=profile_to_pb(PROFILE), block_hashes=_h(i)))
        if stall is not None:
            stall()
        yield pb.PutBytesRequest(data=bytes([value]) * NBYTES)
    return await sv.PutBytes(messages(), Context())


def test_a_put_bytes_stream_slower_than_its_lease_is_refused_and_stores_nothing():
    clock = Clock()
    sv = _servicer(clock)

    def stall():  # the client stalls past its write lease; the reaper runs meanwhile
        clock.now += 2.0
        sv.store.reap()

    with pytest.raises(FailedPrecondition, match="lease lapsed"):
        asyncio.run(_put_bytes(sv, 1, 7, stall))
    assert sv.store.blocks.get(_h(1)) is None and len(sv.store.leases) == 0
    assert sv.store.blocks.num_fenced() == 1  # its slot quarantined, as any lapsed writer's


def test_a_put_bytes_answers_another_writers_uncommitted_blocks_as_pending():
    sv = _servicer(Clock())
    lease, _ = sv.store.allocate_put("other", [_h(1)], None, 0, "o")  # writing, not committed
    resp = asyncio.run(_put_bytes(sv, 1, 7))
    assert (resp.written, resp.already_present, resp.pending) == (0, 0, 1)
    sv.store.release("other", lease.lease_id)


def test_a_get_bytes_stream_keeps_its_blocks_however_slowly_it_is_read():
    clock = Clock()
    sv = _servicer(clock)
    asyncio.run(_put_bytes(sv, 2, 0x22))

    async def read_slowly():
        stream = sv.GetBytes(pb.GetBytesRequest(profile=profile_to_pb(PROFILE), block_hashes=_h(2)), Context())
        head = await anext(stream)
        clock.now += 60.0  # far past any lease: the stream's lasts as long as the stream
        sv.store.reap()
        for i, value in ((3, 0x33), (4, 0x44)):  # the store turns over meanwhile: 4 evicts 3, not 2
            assert (await _put_bytes(sv, i, value)).written == 1
        data = await anext(stream)
        await stream.aclose()
        return head, data

    head, data = asyncio.run(read_slowly())
    assert head.num_blocks == 1 and data.data == bytes([0x22]) * NBYTES
    assert len(sv.store.leases) == 0 and sv.store.blocks.get(_h(2)).pins == 0
