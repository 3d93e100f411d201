"""BlockStore in one process (no transport): the slots a put and a get answer, what a commit
leaves pinned, evictable and indexed, and the refusals of leases that are not the caller's or
no longer open. The store process tests (test_kvstore) cover the same calls end to end; these
pin down exact slots, pins and counts."""

from __future__ import annotations

import pytest

from pdserve.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from pdserve.kv.checksum import checksum_of
from services.kvstore.leases import ENDED_REMEMBERED, HoldLease, Leases, ReadLease, WriteLease
from services.kvstore.memory import TierMemory
from services.kvstore.store import DEVICE, DRAM, BlockStore, SlotState

NBYTES = 8


class RecordingIndex:
    """An IndexSink that records what it is told (a stand-in for the Redis mirror, named as such)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def committed(self, keys, tiers):
        self.events += [("committed", k, t) for k, t in zip(keys, tiers, strict=True)]

    def moved(self, key, tier):
        self.events.append(("moved", key, tier))

    def dropped(self, key):
        self.events.append(("dropped", key))

    def looked_up(self, hits, misses):
        self.events.append(("looked_up", hits, misses))


def _store(device: int = 4, dram: int = 4, clock=None) -> tuple[BlockStore, RecordingIndex]:
    index = RecordingIndex()
    kw = {"clock": clock} if clock else {}
    return BlockStore(TierMemory("device", device, NBYTES), TierMemory("dram", dram, NBYTES), index=index,
                      fence_s=5.0, **kw), index


def _h(i: int) -> bytes:
    return bytes([i]) * 16


def _write(store: BlockStore, slots, value: int = 7) -> list[int]:
    """Fill the WRITE slots as a writer would; their checksums."""
    sums = []
    for s in slots:
        if s.state == SlotState.WRITE:
            store.blocks.view(s.block).fill_(value)
            sums.append(checksum_of(store.blocks.view(s.block)))
    return sums


def _put(store: BlockStore, hashes, owner: str = "w", **kw):
    lease, slots = store.allocate_put(owner, hashes, None, 0, "r", **kw)
    sums = _write(store, slots)
    new = [s.block.key for s in slots if s.state == SlotState.WRITE]
    if new:
        store.commit(owner, lease.lease_id, new, sums)
    return lease, slots


def test_an_all_new_put_answers_its_slots_spilling_to_dram_and_commits_each_block():
    store, index = _store()
    hashes = [_h(i) for i in range(6)]
    lease, slots = store.allocate_put("w", hashes, None, 0, "r1")
    assert [s.block.key for s in slots] == hashes
    assert [(s.block.tier, s.block.slot) for s in slots] == [(DEVICE, i) for i in range(4)] + [(DRAM, 0), (DRAM, 1)]
    assert [store.blocks.address(s.block) for s in slots] == [
        *(store.tiers[DEVICE].address(i) for i in range(4)), *(store.tiers[DRAM].address(i) for i in range(2))]
    assert [s.state for s in slots] == [SlotState.WRITE] * 6
    assert [(s.block.pins, s.block.committed) for s in slots] == [(1, False)] * 6
    assert list(lease.uncommitted) == hashes and len(lease.lease_id) == 32

    sums = _write(store, slots)
    assert store.commit("w", lease.lease_id, [hashes[5], hashes[0]], [sums[5], sums[0]]) == (2, False)
    assert [store.blocks.get(h).pins for h in hashes] == [0, 1, 1, 1, 1, 0]
    assert store.blocks.order(DEVICE) == [hashes[0]] and store.blocks.order(DRAM) == [hashes[5]]
    assert store.blocks.get(hashes[5]).checksum == sums[5]
    with pytest.raises(FailedPrecondition, match="is not one it writes, or is committed"):
        store.commit("w", lease.lease_id, [hashes[0]], [sums[0]])  # committed already: refused, not "done"
    with pytest.raises(InvalidArgument, match="1 checksums for 2 blocks"):
        store.commit("w", lease.lease_id, hashes[1:3], sums[1:2])
    assert store.commit("w", lease.lease_id, hashes[1:5], sums[1:5]) == (4, True)
    with pytest.raises(FailedPrecondition, match="has been committed in full"):
        store.commit("w", lease.lease_id, hashes[1:2], sums[1:2])
    assert [e for e in index.events if e[0] == "committed"] == [
        ("committed", hashes[5], DRAM), ("committed", hashes[0], DEVICE),
        *[("committed", h, DEVICE) for h in hashes[1:4]], ("committed", hashes[4], DRAM)]
    assert store.counters.bytes_written == 6 * NBYTES
    assert len(store.leases) == 0


def test_a_put_of_present_pending_and_new_blocks_and_a_tail_with_a_hold():
    store, _ = _store(device=8)
    first, slots = store.allocate_put("w1", [_h(1), _h(2)], None, 0, "r1")
    sums = _write(store, slots)
    store.commit("w1", first.lease_id, [_h(1)], sums[:1])  # 1 committed, 2 still being written by r1
    lease, slots = store.allocate_put("w2", [_h(1), _h(2), _h(3)], b"tail:r2", 0, "r2", hold_ms=1000)
    assert [s.block.key for s in slots] == [_h(1), _h(2), _h(3), b"tail:r2"]
    assert [s.state for s in slots] == [SlotState.PRESENT, SlotState.PENDING, SlotState.WRITE, SlotState.WRITE]
    assert [s.block.slot for s in slots] == [0, 1, 2, 3] and slots[3].block.is_tail
    hold = store.leases.find(lease.hold_id, None, HoldLease)
    assert [b.key for b in hold.blocks] == [_h(1), _h(3)]  # not r1's block still being written
    assert [store.blocks.get(h).pins for h in (_h(1), _h(2), _h(3))] == [1, 1, 2]
    with pytest.raises(FailedPrecondition, match="was never part of it"):
        store.commit("w2", lease.lease_id, [_h(4)], [0])
    with pytest.raises(FailedPrecondition, match="is not one it writes"):
        store.commit("w2", lease.lease_id, [_h(2)], [0])  # another writer's block
    with pytest.raises(PermissionDenied, match="belongs to another client"):
        store.commit("w1", lease.lease_id, [_h(3)], [0])
    sums = _write(store, slots)
    assert store.commit("w2", lease.lease_id, [_h(3)], sums[:1], tail=True, tail_checksum=sums[1],
                        tail_ttl_ms=500) == (2, True)
    assert store.blocks.get(_h(3)).pins == 1 and store.blocks.tail(b"tail:r2").pins == 1  # the hold's, the TTL's
    assert b"tail:r2" in store.tail_ttls
    assert store.release("anyone", hold.lease_id) == (2, 0)  # a hold is a capability: its id is enough
    assert [store.blocks.get(h).pins for h in (_h(1), _h(3))] == [0, 0]
    with pytest.raises(InvalidArgument, match="already in use"):
        store.allocate_put("w2", [], b"tail:r2", 0, "r3")


def test_a_get_pins_the_longest_committed_prefix_and_a_dram_hit_is_promoted_on_release():
    store, index = _store()
    hashes = [_h(i) for i in range(6)]  # four on the device, two spilled to DRAM
    put, slots = store.allocate_put("w", hashes, None, 0, "w")
    sums = _write(store, slots)
    store.commit("w", put.lease_id, hashes[:5], sums[:5])  # the sixth stays uncommitted: the prefix ends there
    index.events.clear()
    lease, blocks, tail = store.get("r", [*hashes, _h(9)], None, 0, "r")
    assert tail is None and [b.key for b in blocks] == hashes[:5] and lease.blocks == blocks
    assert [(b.tier, b.slot) for b in blocks] == [(DEVICE, i) for i in range(4)] + [(DRAM, 0)]
    assert [store.blocks.get(h).pins for h in hashes] == [1] * 6  # the sixth: its writer's pin
    assert [b.promote for b in blocks] == [False] * 4 + [True]
    assert store.blocks.order(DEVICE) == [] and store.blocks.order(DRAM) == []
    assert (store.counters.hits, store.counters.misses, store.counters.tier_hits) == (5, 2, {DEVICE: 4, DRAM: 1})
    assert store.counters.bytes_read == 5 * NBYTES
    assert index.events == [("looked_up", 5, 2)]

    # Released, the DRAM hit is promoted: it swaps places with the device's first to evict.
    assert store.release("r", lease.lease_id) == (5, 0)
    assert (store.blocks.get(hashes[4]).tier, store.blocks.get(hashes[4]).slot) == (DEVICE, 0)
    assert (store.blocks.get(hashes[0]).tier, store.blocks.get(hashes[0]).slot) == (DRAM, 0)
    assert store.counters.promotions == 1
    assert index.events[1:] == [("moved", hashes[0], DRAM), ("moved", hashes[4], DEVICE)]
    assert all(store.blocks.verify(store.blocks.get(h)) for h in hashes[:5])  # the swap kept every byte
    with pytest.raises(FailedPrecondition, match="has been released"):
        store.release("r", lease.lease_id)
    none, empty, _ = store.get("r", [_h(7)], None, 0, "r")
    assert none is None and empty == []
    with pytest.raises(InvalidArgument, match="repeat within one get"):
        store.get("r", [_h(0), _h(1), _h(0)], None, 0, "r")


def test_a_write_lease_that_ends_uncommitted_fences_its_slots_until_the_quarantine_is_over():
    now = [100.0]
    store, _ = _store(device=4, dram=0, clock=lambda: now[0])
    lease, slots = store.allocate_put("w", [_h(1), _h(2)], None, 1000, "w")
    sums = _write(store, slots)
    store.commit("w", lease.lease_id, [_h(1)], sums[:1])
    now[0] = 101.5
    assert store.reap() == 1  # lapsed with _h(2) uncommitted
    assert store.blocks.get(_h(2)) is None and store.blocks.num_fenced() == 1
    with pytest.raises(FailedPrecondition, match="has lapsed"):
        store.commit("w", lease.lease_id, [_h(2)], sums[1:])  # never answered as done
    # Its slot is not handed out while the stale writer may still land bytes in it.
    again, slots = store.allocate_put("w", [_h(2), _h(3), _h(4)], None, 0, "w2")
    assert sorted(s.block.slot for s in slots) == [0, 2, 3] and store.blocks.get(_h(1)) is None  # (evicted)
    assert store.tier_stats(DEVICE)["used_blocks"] == 4
    now[0] = 104.0
    store.release("w", again.lease_id)  # fenced too: three more
    assert store.blocks.num_fenced() == 4
    now[0] = 106.6
    store.reap()
    assert store.blocks.num_fenced() == 3 and store.tiers[DEVICE].allocator.num_free == 1  # the first is free
    now[0] = 200.0
    store.reap()
    assert store.blocks.num_fenced() == 0 and store.tiers[DEVICE].allocator.num_free == 4


def test_a_reported_block_whose_copy_is_bad_is_dropped_at_once_and_freed_when_unpinned():
    store, index = _store(device=4, dram=0)
    _put(store, [_h(1), _h(2)])
    lease, blocks, _ = store.get("r", [_h(1), _h(2)], None, 0, "r")
    with pytest.raises(PermissionDenied):
        store.report_corrupt("x", lease.lease_id, [_h(2)], False)
    with pytest.raises(NotFound, match="does not hold every block"):
        store.report_corrupt("r", lease.lease_id, [_h(3)], False)
    assert store.report_corrupt("r", lease.lease_id, [_h(2)], False) == 0  # its copy is good: kept
    store.blocks.view(blocks[1])[3] ^= 0xFF  # a stale writer's byte lands in the slot
    assert store.report_corrupt("r", lease.lease_id, [_h(2)], False) == 1
    assert store.blocks.get(_h(2)) is None and ("dropped", _h(2)) in index.events
    assert store.counters.corrupt == 1 and store.tiers[DEVICE].allocator.num_free == 2  # still pinned
    other, found, _ = store.get("r2", [_h(1), _h(2)], None, 0, "r")
    assert [b.key for b in found] == [_h(1)]  # never served again
    store.release("r", lease.lease_id)
    store.release("r2", other.lease_id)
    assert store.tiers[DEVICE].allocator.num_free == 3 and store.blocks.order(DEVICE) == [_h(1)]


def test_a_demotion_that_finds_a_block_corrupt_drops_it_instead():
    store, index = _store(device=2, dram=2)
    _put(store, [_h(1), _h(2)])
    store.blocks.view(store.blocks.get(_h(1)))[0] ^= 1
    _put(store, [_h(3)])  # evicts _h(1): its copy in DRAM fails its checksum
    assert store.blocks.get(_h(1)) is None and store.counters.corrupt == 1
    assert ("dropped", _h(1)) in index.events and ("moved", _h(1), DRAM) not in index.events
    assert store.tiers[DRAM].allocator.num_free == 2


def test_leases_are_random_owned_lapse_at_their_deadline_and_ended_ones_are_refused_with_a_reason():
    now = [100.0]
    leases = Leases(default_s=10.0, clock=lambda: now[0])
    read = leases.open(ReadLease, "a", 0, "x")
    write = leases.open(WriteLease, "b", 2500, "y")
    assert (read.deadline, write.deadline) == (110.0, 102.5)
    assert len({read.lease_id, write.lease_id}) == 2 and all(len(x.lease_id) == 32 for x in (read, write))
    watched = leases.open(ReadLease, "c", 1000, "z", watching=True)
    now[0] = 103.0
    assert leases.lapsed(now[0]) == [write]  # not the watched one, past its deadline too
    with pytest.raises(PermissionDenied):
        leases.renew(write.lease_id, "a", 5000)
    assert leases.renew(write.lease_id, "b", 5000) == 108.0 and leases.lapsed(now[0]) == []
    with pytest.raises(NotFound, match="is unknown"):
        leases.renew("0" * 32, "b", 0)
    with pytest.raises(FailedPrecondition, match="is a ReadLease"):
        leases.find(watched.lease_id, "c", WriteLease)
    leases.end(write, "lapsed")
    with pytest.raises(FailedPrecondition, match="has lapsed"):
        leases.find(write.lease_id, "b")
    for _ in range(ENDED_REMEMBERED):
        leases.end(leases.open(HoldLease, "d", 0, "h"), "been released")
    with pytest.raises(NotFound, match="is unknown"):
        leases.find(write.lease_id, "b")


def test_a_store_that_turns_over_keeps_every_slot_either_free_or_one_blocks():
    def put(i: int) -> list[bytes]:
        return [bytes([i % 256, i // 256]) + bytes([k]) * 14 for k in range(8)]

    store, _ = _store(device=16, dram=4)
    for i in range(500):
        _put(store, put(i))
        if i % 3 == 0:  # a reader keeps the first block of some puts in use: the rest are evicted first
            read, _, _ = store.get("r", put(i)[:1], None, 0, "r")
            store.release("r", read.lease_id)
    blocks = store.blocks.blocks()
    assert len(blocks) == 20 and all(b.pins == 0 and b.committed for b in blocks)
    assert {b.key for b in blocks if b.tier == DEVICE} == {*put(498), *put(499)}  # the device: the last two puts
    assert sorted(b.key for b in blocks if b.tier == DRAM) == put(497)[4:]  # DRAM: the last 4 the last put demoted
    for tier, n in ((DEVICE, 16), (DRAM, 4)):
        assert sorted(b.slot for b in blocks if b.tier == tier) == list(range(n))
        assert len(store.blocks.order(tier)) == n and store.tiers[tier].allocator.num_free == 0


def test_the_servicer_answers_slots_and_checksums_in_the_wires_codes():
    """Answers as the client reads them: packed addresses, a tier and a state byte per slot in
    the protocol's codes, the writer's checksums to readers; calls name their client."""
    import asyncio

    from pdserve.bench.kvstore_bench import _layouts
    from pdserve.kvclient.results import slots_from_pb
    from pdserve.rpc.convert import profile_to_pb
    from pdserve.v1 import kvstore_pb2 as pb
    from services.kvstore.servicer import KVStoreServicer

    class Context:  # a stand-in for grpc's servicer context: only the metadata is read
        def __init__(self, client: str):
            self.md = (("pdserve-client-id", client),) if client else ()

        def invocation_metadata(self):
            return self.md

    profile = _layouts(16)["tiny"]
    store = BlockStore(TierMemory("device", 4, NBYTES), TierMemory("dram", 4, NBYTES))
    servicer = KVStoreServicer(store, profile, "seg", "host", max_blocks=16)
    dev, dram = store.tiers[DEVICE].base_address, store.tiers[DRAM].base_address
    me = Context("me")

    def call(method, **kw):
        return asyncio.run(getattr(servicer, method)(getattr(pb, f"{method.removesuffix('Put')}PutRequest"
                                                             if method.endswith("Put") else f"{method}Request")(**kw),
                                                     me))

    first = call("AllocatePut", profile=profile_to_pb(profile), block_hashes=b"".join(map(_h, range(3))))
    call("CommitPut", lease_id=first.lease_id, block_hashes=b"".join(map(_h, range(3))), checksums=[11, 12, 13])
    put = call("AllocatePut", profile=profile_to_pb(profile), block_hashes=b"".join(map(_h, range(6))))
    slots = slots_from_pb(put.slots)
    assert slots.addresses == [dev, dev + 8, dev + 16, dev + 24, dram, dram + 8] and slots.checksums == []
    assert slots.tiers == [pb.TIER_DEVICE] * 4 + [pb.TIER_DRAM] * 2
    assert slots.states == [pb.SLOT_STATE_PRESENT] * 3 + [pb.SLOT_STATE_WRITE] * 3
    call("CommitPut", lease_id=put.lease_id, block_hashes=b"".join(map(_h, range(3, 6))), checksums=[14, 15, 16])
    got = asyncio.run(servicer.Get(pb.GetRequest(profile=profile_to_pb(profile), block_hashes=_h(4) + _h(0) + _h(7)),
                                   me))
    slots = slots_from_pb(got.slots)
    assert slots.addresses == [dram, dev] and slots.tiers == [pb.TIER_DRAM, pb.TIER_DEVICE]
    assert slots.states == [pb.SLOT_STATE_PRESENT] * 2 and slots.checksums == [15, 11]
    from pdserve.errors import InvalidArgument as Invalid

    with pytest.raises(Invalid, match="17 bytes is not a whole number of 16-byte hashes"):
        asyncio.run(servicer.Get(pb.GetRequest(profile=profile_to_pb(profile), block_hashes=b"x" * 17), me))
    with pytest.raises(Invalid, match="metadata 'pdserve-client-id' is missing"):
        asyncio.run(servicer.Get(pb.GetRequest(profile=profile_to_pb(profile), block_hashes=_h(0)), Context("")))


def test_the_run_allocator_hands_out_runs_and_merges_what_is_freed():
    from services.kvstore.memory import RunAllocator

    a = RunAllocator(10)
    assert a.allocate(3).tolist() == [0, 1, 2] and a.allocate(4).tolist() == [3, 4, 5, 6]
    for slot in (1, 4, 5):
        a.free(slot)
    assert a.num_free == 6 and a._starts == [1, 4, 7] and a._lengths == {1: 1, 4: 2, 7: 3}
    assert a.allocate(2).tolist() == [4, 5]  # the first run that fits
    a.free(2)
    a.free(0)
    assert a._starts == [0, 7] and a._lengths == {0: 3, 7: 3}  # merged both ways
    assert a.allocate(5).tolist() == [0, 1, 2, 7, 8]  # no run fits: the largest runs, fewest of them
    with pytest.raises(RuntimeError, match="double free of slot 9"):
        a.free(9)
    with pytest.raises(RuntimeError, match="want 2 slots, 1 free"):
        a.allocate(2)


def test_a_tail_dropped_as_corrupt_keeps_its_ttl_pin_until_the_ttl_ends_then_frees_its_slot():
    now = [100.0]
    store, _ = _store(device=4, dram=1, clock=lambda: now[0])
    lease, slots = store.allocate_put("w", [_h(1)], b"tail:t", 0, "w")
    sums = _write(store, slots)
    store.commit("w", lease.lease_id, [_h(1)], sums[:1], tail=True, tail_checksum=sums[1], tail_ttl_ms=1000)
    tail = store.blocks.tail(b"tail:t")
    store.blocks.view(tail)[0] ^= 1
    assert not store.blocks.verify(tail)
    store.blocks.detach(tail)  # as GetBytes does with a block that fails
    assert store.blocks.tail(b"tail:t") is None and tail.pins == 1  # its TTL's pin
    assert store.get("r", [], b"tail:t", 0, "r") == (None, [], None)  # never served
    assert store.tiers[DEVICE].allocator.num_free == 2
    now[0] = 102.0
    store.reap()
    assert tail.pins == 0 and store.tiers[DEVICE].allocator.num_free == 3 and not store.tail_ttls
    # A tail read is read once: the reader's release takes its TTL pin with it.
    lease, slots = store.allocate_put("w", [], b"tail:u", 0, "w")
    store.commit("w", lease.lease_id, [], [], tail=True, tail_checksum=_write(store, slots)[0])
    read, _, tail = store.get("r", [], b"tail:u", 0, "r")
    assert tail.pins == 2
    store.release("r", read.lease_id)
    assert tail.pins == 0 and store.blocks.tail(b"tail:u") is None and not store.tail_ttls


def test_one_client_may_hold_only_so_many_leases_and_a_refusal_allocates_nothing():
    store = BlockStore(TierMemory("device", 4, NBYTES), TierMemory("dram", 4, NBYTES), max_leases_per_client=2)
    first, _ = store.allocate_put("a", [_h(1)], None, 0, "r1")
    store.get("a", [_h(9)], None, 0, "r2")  # a miss opens no lease
    second, _ = store.allocate_put("a", [_h(2)], None, 0, "r2")
    used = store.tier_stats(DEVICE)["used_blocks"]
    with pytest.raises(ResourceExhausted, match="client 'a' already holds 2 open leases"):
        store.allocate_put("a", [_h(3)], None, 0, "r3")
    with pytest.raises(ResourceExhausted):
        store.allocate_put("a", [_h(3)], None, 0, "r3", hold_ms=1000)
    assert store.tier_stats(DEVICE)["used_blocks"] == used == 2
    store.allocate_put("b", [_h(3)], None, 0, "r4")  # another client's count is its own
    store.release("a", first.lease_id)
    store.allocate_put("a", [_h(4)], None, 0, "r5")
    assert len(store.leases) == 3
