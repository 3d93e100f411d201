"""BlockStore bookkeeping in one process (no transport): the slot columns a put and a get answer,
and what a commit leaves pinned, evictable and indexed. The store process tests (test_kvstore)
cover the same calls end to end; these pin down exact slots and counts."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.errors import InvalidArgument, NotFound
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


def _store(device: int = 4, dram: int = 4) -> tuple[BlockStore, RecordingIndex]:
    index = RecordingIndex()
    return BlockStore(TierMemory("device", device, NBYTES), TierMemory("dram", dram, NBYTES), index=index), index


def _h(i: int) -> bytes:
    return bytes([i]) * 16


def _keys(store: BlockStore, block_ids) -> list[bytes | None]:
    return [store.table.key(i) for i in np.asarray(block_ids, np.int64).tolist()]


def test_an_all_new_put_answers_its_slots_as_columns_spilling_to_dram():
    store, index = _store()
    dev, dram = store.tiers[DEVICE].base_address, store.tiers[DRAM].base_address
    hashes = [_h(i) for i in range(6)]
    lease, slots = store.allocate_put(hashes, None, 0, "r1")
    assert _keys(store, slots.rows) == hashes
    assert slots.addresses.tolist() == [dev, dev + 8, dev + 16, dev + 24, dram, dram + 8]
    assert slots.tiers == [DEVICE] * 4 + [DRAM] * 2
    assert list(slots.states) == [SlotState.WRITE] * 6
    assert store.blocks.slot_ref(int(slots.rows[5]), SlotState.WRITE) == (hashes[5], 5, dram + 8, DRAM, SlotState.WRITE)
    assert [(store.block(h).pins, store.block(h).committed) for h in hashes] == [(1, False)] * 6
    assert _keys(store, lease.pinned) == hashes

    assert store.commit(lease.lease_id, [hashes[5], hashes[0], hashes[0]]) == (2, False)  # a repeat counts once
    assert _keys(store, lease.pinned) == hashes[1:5]
    assert [store.block(h).pins for h in hashes] == [0, 1, 1, 1, 1, 0]
    assert len(store.evictable[DEVICE]) == 1 and len(store.evictable[DRAM]) == 1
    assert store.commit(lease.lease_id) == (4, True)
    assert store.commit(lease.lease_id) == (0, True)  # idempotent once closed
    assert [e for e in index.events if e[0] == "committed"] == [
        ("committed", hashes[5], DRAM), ("committed", hashes[0], DEVICE),
        *[("committed", h, DEVICE) for h in hashes[1:4]], ("committed", hashes[4], DRAM)]
    assert store.counters.bytes_written == 6 * NBYTES
    assert all(store.block(h).pins == 0 and store.block(h).committed for h in hashes)
    assert len(store.leases) == 0


def test_a_put_of_present_pending_and_new_blocks_and_a_tail():
    store, _ = _store(device=8)
    dev = store.tiers[DEVICE].base_address
    first, _ = store.allocate_put([_h(1), _h(2)], None, 0, "r1")
    store.commit(first.lease_id, [_h(1)])  # 1 committed, 2 still being written by r1
    lease, slots = store.allocate_put([_h(1), _h(2), _h(3)], b"tail:r2", 0, "r2", hold_ms=1000)
    assert _keys(store, slots.rows) == [_h(1), _h(2), _h(3), b"tail:r2"]
    assert list(slots.states) == [SlotState.PRESENT, SlotState.PENDING, SlotState.WRITE, SlotState.WRITE]
    assert slots.addresses.tolist() == [dev, dev + 8, dev + 16, dev + 24]
    assert store.block(b"tail:r2").is_tail and not store.block(_h(3)).is_tail
    hold = store.leases.get(lease.hold_id)
    assert _keys(store, hold.held) == [_h(1), _h(3)]  # not r1's block still being written
    assert [store.block(h).pins for h in (_h(1), _h(2), _h(3))] == [1, 1, 2]
    with pytest.raises(NotFound, match="is not part of write lease"):
        store.commit(lease.lease_id, [_h(3), _h(4)])
    assert store.commit(lease.lease_id, [_h(1), b"tail:r2", _h(3)], tail_ttl_ms=500) == (2, True)
    assert store.block(_h(3)).pins == 1 and store.block(b"tail:r2").pins == 1  # the hold's, the TTL's
    assert b"tail:r2" in store.held_tails
    assert store.release(hold.lease_id) == (2, 0)
    assert [store.block(h).pins for h in (_h(1), _h(3))] == [0, 0]


def test_a_get_pins_the_longest_committed_prefix_and_answers_its_columns():
    store, index = _store()
    dev, dram = store.tiers[DEVICE].base_address, store.tiers[DRAM].base_address
    hashes = [_h(i) for i in range(6)]  # four on the device, two spilled to DRAM
    put, _ = store.allocate_put(hashes, None, 0, "w")
    store.commit(put.lease_id, hashes[:5])  # the sixth stays uncommitted: the prefix ends before it
    index.events.clear()
    lease, slots, tail = store.get([*hashes, _h(9)], None, 0, "r")
    assert tail is None
    assert _keys(store, slots.rows) == hashes[:5]
    assert slots.addresses.tolist() == [dev, dev + 8, dev + 16, dev + 24, dram]
    assert slots.tiers == [DEVICE] * 4 + [DRAM] and list(slots.states) == [SlotState.PRESENT] * 5
    assert _keys(store, lease.pinned) == hashes[:5]
    assert [store.block(h).pins for h in hashes] == [1] * 6  # the sixth: its writer's pin
    assert [store.block(h).promote_on_release for h in hashes[:5]] == [False] * 4 + [True]
    assert len(store.evictable[DEVICE]) == 0 and len(store.evictable[DRAM]) == 0
    assert (store.counters.hits, store.counters.misses, store.counters.tier_hits) == (5, 2, {DEVICE: 4, DRAM: 1})
    assert store.counters.bytes_read == 5 * NBYTES
    assert index.events == [("looked_up", 5, 2)]

    # Released, the DRAM hit is promoted: it swaps places with the device's first to evict.
    assert store.release(lease.lease_id) == (5, 0)
    assert store.locate(hashes[4]) == (DEVICE, 0)
    assert store.locate(hashes[0]) == (DRAM, 0)
    assert store.counters.promotions == 1
    assert index.events[1:] == [("moved", hashes[4], DEVICE), ("moved", hashes[0], DRAM)]
    assert store.release(put.lease_id) == (0, 1)  # the writer gives up its last block: reclaimed
    assert hashes[5] not in store.table and store.tiers[DRAM].allocator.num_free == 3
    none, empty, _ = store.get([_h(7)], None, 0, "r")
    assert none is None and len(empty) == 0



def test_a_get_answers_the_blocks_the_store_holds_now_wherever_their_puts_left_them():
    """A chain whose blocks were written by several puts, one of them dropped and written again
    elsewhere: a get answers the longest committed prefix of what the store holds now, exactly,
    and refuses a chain that names a block twice."""
    store, _ = _store(device=8)
    dev = store.tiers[DEVICE].base_address
    a, _ = store.allocate_put([_h(0), _h(1), _h(2)], None, 0, "a")
    store.commit(a.lease_id, [_h(0), _h(1)])
    assert store.release(a.lease_id) == (0, 1)  # its writer gave up: _h(2) is dropped
    assert _h(2) not in store.table and store.table.key(2) is None and store.table.row(_h(2)) == -1
    b, slots = store.allocate_put([_h(3), _h(4), _h(2)], None, 0, "b")
    store.commit(b.lease_id)
    assert slots.addresses.tolist() == [dev + 16, dev + 24, dev + 32]  # _h(2)'s old row now holds _h(3)
    lease, got, _ = store.get([_h(0), _h(1), _h(2), _h(3)], None, 0, "r")
    assert _keys(store, got.rows) == [_h(0), _h(1), _h(2), _h(3)]
    assert got.addresses.tolist() == [dev, dev + 8, dev + 32, dev + 16]
    assert lease.pinned.tolist() == [0, 1, 4, 2] and [store.block(_h(i)).pins for i in range(5)] == [1, 1, 1, 1, 0]
    store.release(lease.lease_id)
    lease, got, _ = store.get([_h(3), _h(4), _h(2), _h(9)], None, 0, "r")
    assert _keys(store, got.rows) == [_h(3), _h(4), _h(2)] and got.addresses.tolist() == [dev + 16, dev + 24, dev + 32]
    with pytest.raises(InvalidArgument, match="repeat within one get"):
        store.get([_h(0), _h(1), _h(0)], None, 0, "r")
    assert [store.block(_h(i)).pins for i in range(5)] == [0, 0, 1, 1, 1]


def test_leases_lapse_at_their_deadline_and_closed_ones_are_remembered_a_while():
    from services.kvstore.leases import CLOSED_REMEMBERED, Leases

    now = [100.0]
    leases = Leases(default_s=10.0, clock=lambda: now[0])
    read, write = leases.new("read", 0, "a"), leases.new("write", 2500, "b")
    assert (read.lease_id, read.deadline, write.lease_id, write.deadline) == ("r1", 110.0, "w2", 102.5)
    watched = leases.new("read", 1000, "c")
    watched.watching = True
    now[0] = 103.0
    assert leases.lapsed(now[0]) == ["w2"]  # not the watched one, past its deadline too
    assert leases.renew("w2", 5000) == 108.0 and leases.lapsed(now[0]) == []
    with pytest.raises(NotFound, match="unknown or lapsed"):
        leases.renew("w9", 0)
    leases.close(write)
    assert "w2" not in leases and leases.closed("w2") and len(leases) == 2
    for _ in range(CLOSED_REMEMBERED):
        leases.close(leases.new("hold", 0, "d"))
    assert not leases.closed("w2") and leases.closed(f"h{3 + CLOSED_REMEMBERED}")


def test_a_store_that_turns_over_leaves_clean_rows_and_sheds_its_dead_order_items():
    """Eviction drops blocks while other blocks of their puts live on: every row without a
    block is clear, every row with one is its key's, and the eviction orders shed their dead
    items (each touch and each move leaves one behind)."""
    from services.kvstore.order import SHED_AFTER

    def put(i: int) -> list[bytes]:
        return [bytes([i % 256, i // 256]) + bytes([k]) * 14 for k in range(8)]

    store, _ = _store(device=16, dram=4)
    for i in range(500):
        lease, _ = store.allocate_put(put(i), None, 0, "w")
        store.commit(lease.lease_id)
        if i % 3 == 0:  # a reader keeps the first block of some puts in use: the rest are evicted first
            read, _, _ = store.get(put(i)[:1], None, 0, "r")
            store.release(read.lease_id)
    t = store.table
    keys = _keys(store, range(t.size))
    assert len(t) == 20 and all(t.row(k) == i for i, k in enumerate(keys))
    assert (t.pins.sum(), t.committed.sum(), t.stamp.astype(bool).sum()) == (0, 20, 20)
    assert set(keys[:16]) == {*put(498), *put(499)}  # the device: the last two puts
    assert sorted(keys[16:]) == put(497)[4:]  # DRAM: the last 4 of the 8 the last put demoted
    assert len(store.evictable[DEVICE]) == 16 and len(store.evictable[DRAM]) == 4
    queued = sum(len(ids) for order in store.evictable.values() for q in order._queues for ids, _ in q)
    assert queued <= 2 * (2 * 20 + SHED_AFTER)


def test_the_servicer_answers_slot_columns_in_the_wires_codes():
    """A control call's answer as the client reads it: packed addresses, and a tier and a state
    byte per slot in the protocol's codes (not the store's own)."""
    from pdserve.bench.kvstore_bench import _layouts
    from pdserve.kv.store_client import slots_from_pb
    from pdserve.v1 import kvstore_pb2 as pb
    from pdserve.wire import profile_to_pb
    from services.kvstore.servicer import KVStoreServicer

    profile = _layouts(16)["tiny"]
    store = BlockStore(TierMemory("device", 4, NBYTES), TierMemory("dram", 4, NBYTES))
    servicer = KVStoreServicer(store, profile, "seg", "host", max_blocks=16)
    dev, dram = store.tiers[DEVICE].base_address, store.tiers[DRAM].base_address

    def call(**kw) -> pb.ControlResponse:
        answer = servicer.control(pb.ControlRequest(call_id=7, **kw))
        assert (answer.call_id, answer.status_code) == (7, 0), answer.status_message
        return answer

    first = call(allocate_put=dict(profile=profile_to_pb(profile), block_hashes=b"".join(map(_h, range(3)))))
    call(commit_put=dict(lease_id=first.allocate_put.lease_id))
    put = call(allocate_put=dict(profile=profile_to_pb(profile), block_hashes=b"".join(map(_h, range(6)))))
    slots = slots_from_pb(put.allocate_put.slots)
    assert slots.addresses.tolist() == [dev, dev + 8, dev + 16, dev + 24, dram, dram + 8]
    assert list(slots.tiers) == [pb.TIER_DEVICE] * 4 + [pb.TIER_DRAM] * 2
    assert list(slots.states) == [pb.SLOT_STATE_PRESENT] * 3 + [pb.SLOT_STATE_WRITE] * 3
    call(commit_put=dict(lease_id=put.allocate_put.lease_id))
    got = call(get=dict(profile=profile_to_pb(profile), block_hashes=_h(4) + _h(0) + _h(7)))
    slots = slots_from_pb(got.get.slots)
    assert slots.addresses.tolist() == [dram, dev] and list(slots.tiers) == [pb.TIER_DRAM, pb.TIER_DEVICE]
    assert list(slots.states) == [pb.SLOT_STATE_PRESENT] * 2
    bad = servicer.control(pb.ControlRequest(call_id=8, get=dict(profile=profile_to_pb(profile),
                                                                  block_hashes=b"x" * 17)))
    assert bad.status_code == 3 and "17 bytes is not a whole number of 16-byte hashes" in bad.status_message


def test_a_commit_held_for_its_answer_is_answered_first_and_done_when_run():
    """On the control socket a commit's bookkeeping runs after its answer is sent: held, the
    commit answers its count and closes its lease, and only `run` commits the blocks; outside a
    held call it all happens at once."""
    store, index = _store()
    hashes = [_h(i) for i in range(3)]
    lease, _ = store.allocate_put(hashes, None, 0, "r1")
    store.deferred.hold()
    assert store.commit(lease.lease_id) == (3, True)
    assert lease.lease_id not in store.leases
    assert [(store.block(h).pins, store.block(h).committed) for h in hashes] == [(1, False)] * 3
    assert [e for e in index.events if e[0] == "committed"] == []
    store.deferred.run()
    assert [(store.block(h).pins, store.block(h).committed) for h in hashes] == [(0, True)] * 3
    assert [e[1] for e in index.events if e[0] == "committed"] == hashes
    lease, _ = store.allocate_put([_h(9)], None, 0, "r2")
    assert store.commit(lease.lease_id) == (1, True)  # not held: done at once
    assert (store.block(_h(9)).pins, store.block(_h(9)).committed) == (0, True)


def test_held_bookkeeping_runs_in_order_and_one_failure_does_not_stop_the_rest():
    from services.kvstore.deferred import Deferred

    deferred, ran = Deferred(), []

    def fail():
        raise RuntimeError("boom")

    deferred(ran.append, 0)  # nothing held: at once
    deferred.hold()
    deferred(ran.append, 1)
    deferred(fail)
    deferred(ran.append, 2)
    assert ran == [0]
    deferred.run()
    assert ran == [0, 1, 2]
    deferred.run()  # nothing held: nothing to do
    assert ran == [0, 1, 2]
