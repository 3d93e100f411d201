"""The store's blocks in their tiers: which key holds which slot, each tier's eviction order, and
the moves between tiers.

Invariants (the store keeps the pins; this keeps the orders and the slots true to them):
- a tier's `evictable` order holds exactly its committed, unpinned, non-tail entries: first the
  copies their writers keep (oldest first), then the rest (least recently used first);
- eviction from the device tier demotes to DRAM (dropping DRAM's LRU to make room, or dropping
  the block itself when DRAM is all pinned); eviction from DRAM drops;
- a DRAM hit is promoted to the device tier when its last reader lets go (`unpin`).
"""

from __future__ import annotations

from pdserve.errors import ResourceExhausted
from services.kvstore.entries import DEVICE, DRAM, Counters, Entry, EvictionOrder, SlotRef, SlotState
from services.kvstore.events import IndexSink
from services.kvstore.memory import DeferredCopies, TierMemory, copy_slot


class TieredBlocks:
    """Owns every entry, each tier's eviction order, slot allocation and the copies between
    tiers. Tells `index` where blocks go; counts evictions and promotions in `counters`."""

    def __init__(self, device: TierMemory, dram: TierMemory, index: IndexSink, counters: Counters):
        self.tiers = {DEVICE: device, DRAM: dram}
        self.base = {DEVICE: device.base_address, DRAM: dram.base_address}
        self.block_nbytes = device.block_nbytes
        self.index = index
        self.counters = counters
        self.entries: dict[bytes, Entry] = {}
        self.evictable: dict[str, EvictionOrder] = {DEVICE: EvictionOrder(), DRAM: EvictionOrder()}
        self.copies = DeferredCopies(self.tiers)  # an allocation's demotions copy in one batch

    def slot_ref(self, entry: Entry, state: SlotState = SlotState.PRESENT) -> SlotRef:
        return SlotRef(entry.key, self.base[entry.tier] + entry.slot * self.block_nbytes, entry.tier, state)

    def pin(self, entry: Entry) -> None:
        if entry.pins == 0:
            self.evictable[entry.tier].discard(entry)
        entry.pins += 1

    def pin_all(self, entries: list[Entry], tiers: list[str]) -> None:
        """pin() of each of `entries` (`tiers`: theirs), a loop at a time rather than a call each."""
        if DRAM not in tiers:
            self.evictable[DEVICE].discard_all(entries)
        else:
            for tier, order in self.evictable.items():
                order.discard_all([e for e, t in zip(entries, tiers, strict=True) if t == tier])
        for entry in entries:
            entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, entry
        if entry.pins == 0 and entry.is_tail:
            self.drop(entry)  # a tail's TTL pin is gone and so is its last reader
        elif entry.pins == 0 and entry.committed:
            self.evictable[entry.tier].add(entry)
            if entry.promote_on_release:
                entry.promote_on_release = False
                self.promote(entry)

    def keep(self, entry: Entry) -> None:
        """Most recently used, and no longer a copy its writer keeps (the writer let it go)."""
        order = self.evictable[entry.tier]
        if entry.duplicate:
            entry.duplicate = False
            if entry.pins == 0 and entry.committed:
                order.discard(entry)
                order.add(entry)
        order.touch(entry)

    def room(self, tier: str) -> int:
        return self.tiers[tier].allocator.num_free + len(self.evictable[tier])

    # -- eviction --------------------------------------------------------------------------
    def drop(self, entry: Entry) -> None:
        self.copies.forget(entry.tier, entry.slot)
        self.evictable[entry.tier].discard(entry)
        self.tiers[entry.tier].allocator.free(entry.slot)
        del self.entries[entry.key]
        entry.dropped, entry.next = True, None  # what it led to is not kept alive by it
        if not entry.is_tail and entry.committed:
            self.index.dropped(entry.key)

    def _free_one(self, tier: str) -> None:
        """Make one slot free in `tier` by evicting its first unpinned block (see EvictionOrder)."""
        entry = self.evictable[tier].pop_first()
        self.counters.evictions[tier] += 1
        if tier == DEVICE and self.room(DRAM) > 0:
            self._move(entry, DRAM)  # demote
        else:
            self.drop(entry)

    def _take_slots(self, tier: str, n: int) -> list[int]:
        mem = self.tiers[tier]
        while mem.allocator.num_free < n:
            self._free_one(tier)
        return mem.allocator.allocate(n)

    def _move(self, entry: Entry, tier: str) -> None:
        [slot] = self._take_slots(tier, 1)
        self.copies.copy(entry.tier, entry.slot, tier, slot)
        self.tiers[entry.tier].allocator.free(entry.slot)
        self.evictable[entry.tier].discard(entry)
        entry.tier, entry.slot = tier, slot
        if entry.pins == 0 and entry.committed and not entry.is_tail:
            self.evictable[tier].add(entry)
        self.index.moved(entry.key, tier)

    def promote(self, entry: Entry) -> None:
        if entry.tier != DRAM or self.room(DEVICE) == 0:
            return
        self.counters.promotions += 1
        if self.tiers[DEVICE].allocator.num_free > 0:
            self._move(entry, DEVICE)
            return
        # Device full: swap with its first to evict, which takes our DRAM slot.
        victim = self.evictable[DEVICE].pop_first()
        self.evictable[DRAM].discard(entry)
        device, dram = self.tiers[DEVICE], self.tiers[DRAM]
        ours = dram.view(entry.slot).clone()
        copy_slot(device, victim.slot, dram, entry.slot)
        device.view(victim.slot).copy_(ours)
        entry.tier, entry.slot, victim.tier, victim.slot = DEVICE, victim.slot, DRAM, entry.slot
        self.evictable[DEVICE].add(entry)
        self.evictable[DRAM].add(victim)
        self.counters.evictions[DEVICE] += 1
        self.index.moved(entry.key, DEVICE)
        self.index.moved(victim.key, DRAM)

    def allocate(self, n: int) -> list[tuple[str, list[int]]]:
        """n new slots, as (tier, slots): device tier first, the rest spilled to DRAM; all or nothing."""
        device = self.tiers[DEVICE].allocator
        if device.num_free >= n:  # room without evicting: nothing moves
            return [(DEVICE, device.allocate(n))]
        room_dev, room_dram = self.room(DEVICE), self.room(DRAM)
        if n > room_dev + room_dram:
            raise ResourceExhausted(
                f"store full: {n} blocks requested, {room_dev + room_dram} can be made free "
                f"(the rest are pinned by readers or writers); retry later"
            )
        n_dev = min(n, room_dev)
        with self.copies.batch():
            return [(DEVICE, self._take_slots(DEVICE, n_dev)), (DRAM, self._take_slots(DRAM, n - n_dev))]
