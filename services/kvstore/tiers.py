"""The store's blocks in their tiers: which block holds which slot (the block table), each tier's
eviction order, and the moves between tiers.

Invariants (the store keeps the pins; this keeps the orders and the slots true to them):
- a tier's `evictable` order holds exactly its committed, unpinned, non-tail blocks: first the
  copies their writers keep (oldest first), then the rest (least recently used first);
- eviction from the device tier demotes to DRAM (dropping DRAM's first to evict to make room,
  or dropping the block itself when DRAM is all pinned); eviction from DRAM drops;
- a DRAM hit is promoted to the device tier when its last reader lets go (`unpin`).

Block ids are rows of the table (see table.py); calls pass them as int64 arrays that do not
repeat.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.errors import ResourceExhausted
from services.kvstore.entries import DEVICE, DRAM, Counters, SlotRef, SlotState
from services.kvstore.events import IndexSink
from services.kvstore.memory import TierMemory, copy_slot, copy_slots
from services.kvstore.order import EvictionOrder
from services.kvstore.table import BlockTable, unpack

_GROUPS = ((DEVICE, 0), (DEVICE, 1), (DRAM, 0), (DRAM, 1))  # BlockTable.queue's: (tier, its order's queue)


class TieredBlocks:
    """Owns the block table, each tier's eviction order, slot allocation and the copies between
    tiers. Tells `index` where blocks go; counts evictions and promotions in `counters`."""

    def __init__(self, device: TierMemory, dram: TierMemory, index: IndexSink, counters: Counters):
        self.tiers = {DEVICE: device, DRAM: dram}
        self.block_nbytes = device.block_nbytes
        self.index = index
        self.counters = counters
        self.table = BlockTable(device, dram)
        self.evictable = {DEVICE: EvictionOrder(self.table), DRAM: EvictionOrder(self.table)}

    def __contains__(self, key: bytes) -> bool:
        return key in self.table

    def slot_ref(self, block_id: int, state: SlotState = SlotState.PRESENT) -> SlotRef:
        t = self.table
        return SlotRef(t.key(block_id), block_id, int(t.address[block_id]), t.tier_of(block_id), state)

    def room(self, tier: str) -> int:
        return self.tiers[tier].allocator.num_free + len(self.evictable[tier])

    def _by_tier(self, block_ids: np.ndarray) -> list[tuple[str, np.ndarray]]:
        split = self.table.split
        if not len(block_ids) or block_ids.max() < split:
            return [(DEVICE, block_ids)]
        in_dram = block_ids >= split
        return [(DEVICE, block_ids[~in_dram]), (DRAM, block_ids[in_dram])]

    # -- pins and use ------------------------------------------------------------------------
    def pin(self, block_ids: np.ndarray, for_read: bool = False) -> int:
        """One more pin each: a pinned block is in no eviction order, so it neither moves nor goes.
        for_read: a DRAM hit is promoted once its last reader lets go. Returns the DRAM hits."""
        left_device, left_dram, marked = self.table.pin(block_ids, for_read)
        self.evictable[DEVICE].left(left_device)
        self.evictable[DRAM].left(left_dram)
        return marked

    def unpin(self, block_ids: np.ndarray) -> None:
        """One pin less each; a block no longer pinned is evictable again (at the recent end), a
        tail goes, and a DRAM hit is promoted."""
        t = self.table
        free, groups, stamp = t.unpin_and_queue(block_ids)
        if groups is not None:  # the common case: committed blocks back to their orders
            self._append(groups, stamp)
            return
        tails = t.is_tail[free]
        if tails.any():
            self.drop(free[tails])  # a tail's TTL pin is gone and so is its last reader
            free = free[~tails]
        free = free[t.committed[free]]
        start = 0
        for at in np.flatnonzero(t.promote[free]).tolist():  # each as if released one by one
            self._requeue(free[start : at + 1])
            t.promote[free[at]] = False
            self.promote(int(free[at]))
            start = at + 1
        self._requeue(free[start:])

    def _requeue(self, block_ids: np.ndarray) -> None:
        """Back in their tiers' orders (at the recent end), those in none."""
        self._append(*self.table.queue(block_ids))

    def _append(self, groups: list[np.ndarray], stamp: int) -> None:
        """Blocks the table stamped from `stamp` on, group by group (BlockTable.queue), into their orders."""
        for (tier, q), part in zip(_GROUPS, groups, strict=True):
            if len(part):
                self.evictable[tier].append(q, part.copy(), stamp)
                stamp += len(part)

    def commit(self, block_ids: np.ndarray) -> None:
        """Committed now (not tails): the writer's pin goes, and with it, for most, the last pin."""
        self._append(*self.table.commit_and_queue(block_ids))

    def keep(self, block_ids: np.ndarray) -> None:
        """Most recently used, and no longer copies their writer keeps (the writer let them go)."""
        t = self.table
        copies = block_ids[t.duplicate[block_ids]]
        if len(copies):
            t.duplicate[copies] = False
            for tier, part in self._by_tier(copies[t.stamp[copies] != 0]):
                self.evictable[tier].discard(part)  # from the copies' queue to the rest's
                self.evictable[tier].add(part)
        for tier, part in self._by_tier(block_ids):
            self.evictable[tier].touch(part)

    # -- eviction ----------------------------------------------------------------------------
    def drop(self, block_ids: np.ndarray) -> None:
        t = self.table
        for tier, part in self._by_tier(block_ids):
            self.evictable[tier].discard(part)
        told = t.keys[block_ids[t.committed[block_ids] & ~t.is_tail[block_ids]]]  # (the index knows these)
        t.clear(block_ids)
        self._free_rows(block_ids.tolist())
        for key in unpack(told):
            self.index.dropped(key)

    def _free_rows(self, rows: list[int]) -> None:
        split = self.table.split
        device = [r for r in rows if r < split]
        if device:
            self.tiers[DEVICE].allocator.free_many(device)
        if len(device) < len(rows):
            self.tiers[DRAM].allocator.free_many([r - split for r in rows if r >= split])

    def allocate(self, n: int) -> np.ndarray:
        """n empty rows: device tier first, the rest spilled to DRAM; all or nothing. Evicts as
        needed (demoting device blocks to DRAM, copying their bytes before it returns)."""
        device = self.tiers[DEVICE].allocator
        if device.num_free >= n:  # room without evicting: nothing moves
            return self._rows(DEVICE, device.allocate(n))
        room_dev, room_dram = self.room(DEVICE), self.room(DRAM)
        if n > room_dev + room_dram:
            raise ResourceExhausted(
                f"store full: {n} blocks requested, {room_dev + room_dram} can be made free "
                f"(the rest are pinned by readers or writers); retry later"
            )
        n_dev = min(n, room_dev)
        moves: dict[int, int] = {}  # DRAM row -> the device row its block comes from
        if n_dev > device.num_free:
            victims = self.evictable[DEVICE].pop(n_dev - device.num_free)
            self.counters.evictions[DEVICE] += len(victims)
            self._demote(victims, moves)
        rows = self._rows(DEVICE, device.allocate(n_dev))
        if n > n_dev:
            dram = self.tiers[DRAM].allocator
            if n - n_dev > dram.num_free:
                dropped = self.evictable[DRAM].pop(n - n_dev - dram.num_free)
                self.counters.evictions[DRAM] += len(dropped)
                for row in dropped.tolist():
                    moves.pop(row, None)  # demoted above, dropped now: never copied
                self.drop(dropped)
            rows = np.concatenate([rows, self._rows(DRAM, dram.allocate(n - n_dev))])
        split = self.table.split
        copy_slots(self.tiers, {(DRAM, dst - split): (DEVICE, src) for dst, src in moves.items()})
        return rows

    def _rows(self, tier: str, slots: np.ndarray) -> np.ndarray:
        return slots if tier == DEVICE else slots + self.table.split

    def _demote(self, victims: np.ndarray, moves: dict[int, int]) -> None:
        """Device blocks (in eviction order, out of the device order) go to DRAM as they would
        one by one: each to a free DRAM slot, or else to the slot of DRAM's first to evict, which
        is dropped (a victim demoted earlier, too); with no room in DRAM at all they are dropped.
        Their device rows are free after; `moves` gets each survivor's (DRAM row, device row)."""
        t = self.table
        order, dram = self.evictable[DRAM], self.tiers[DRAM].allocator
        if dram.num_free + len(order) == 0:
            self.drop(victims)
            return
        k = len(victims)
        landing = (dram.allocate(min(k, dram.num_free)) + t.split).tolist()
        old_copies, old_rest = (deque(q) for q in order.peek(k - len(landing)))
        copy = t.duplicate[victims].tolist()
        queued: tuple[deque[int], deque[int]] = (deque(), deque())  # victims in DRAM by now: copies, rest
        dropped_old: list[int] = []  # DRAM rows whose blocks go
        dropped_new: set[int] = set()  # victims that landed, then went
        for i in range(k):
            if i >= len(landing):  # DRAM full: its first to evict goes (copies first, old before new)
                if old_copies:
                    row = old_copies.popleft()
                    dropped_old.append(row)
                elif queued[0]:
                    j = queued[0].popleft()
                    row = landing[j]
                    dropped_new.add(j)
                elif old_rest:
                    row = old_rest.popleft()
                    dropped_old.append(row)
                else:
                    j = queued[1].popleft()
                    row = landing[j]
                    dropped_new.add(j)
                landing.append(row)
            queued[0 if copy[i] else 1].append(i)
        self.counters.evictions[DRAM] += len(dropped_old) + len(dropped_new)  # each made room once
        victim_rows = victims.tolist()
        if dropped_old:
            self.drop_kept_rows(np.array(dropped_old, dtype=np.int64))
        gone = [victim_rows[j] for j in sorted(dropped_new)]
        if gone:
            self.drop_kept_rows(np.array(gone, dtype=np.int64))
        staying = [i for i in range(k) if i not in dropped_new]
        src = np.array([victim_rows[i] for i in staying], dtype=np.int64)
        dst = np.array([landing[i] for i in staying], dtype=np.int64)
        t.move(src, dst)
        order.add(dst)
        # Rows taken for victims that went again, and the victims' device rows, are free.
        used = set(dst.tolist())
        self._free_rows([r for r in set(landing) if r not in used] + victim_rows)
        for i, j, key in zip(src.tolist(), dst.tolist(), unpack(t.keys[dst]), strict=True):
            moves[j] = i
            self.index.moved(key, DRAM)

    def drop_kept_rows(self, block_ids: np.ndarray) -> None:
        """Forget these blocks but keep their rows taken (the caller reuses or frees them)."""
        t = self.table
        for tier, part in self._by_tier(block_ids):
            self.evictable[tier].discard(part)
        keys = t.keys[block_ids]  # (evictable: committed, no tails)
        t.clear(block_ids)
        for key in unpack(keys):
            self.index.dropped(key)

    def promote(self, block_id: int) -> None:
        """Move a DRAM block to the device tier: to a free slot, or in a swap with the device's
        first to evict."""
        t = self.table
        if block_id < t.split or self.room(DEVICE) == 0:
            return
        self.counters.promotions += 1
        device, dram = self.tiers[DEVICE], self.tiers[DRAM]
        src = np.array([block_id], dtype=np.int64)
        self.evictable[DRAM].discard(src)
        dram_slot = t.slot_of(block_id)
        key = t.key(block_id)
        if device.allocator.num_free > 0:
            [slot] = device.allocator.allocate(1).tolist()
            copy_slot(dram, dram_slot, device, slot)
            dst = np.array([slot], dtype=np.int64)
            t.move(src, dst)
            dram.allocator.free(dram_slot)
            self.evictable[DEVICE].add(dst)
            self.index.moved(key, DEVICE)
            return
        victim = self.evictable[DEVICE].pop(1)
        [v] = victim.tolist()
        ours = dram.view(dram_slot).clone()
        copy_slot(device, v, dram, dram_slot)
        device.view(v).copy_(ours)
        t.swap(block_id, v)
        self.evictable[DEVICE].add(victim)  # row v: ours now
        self.evictable[DRAM].add(src)  # the victim, in our old row
        self.counters.evictions[DEVICE] += 1
        self.index.moved(key, DEVICE)
        self.index.moved(t.key(block_id), DRAM)

