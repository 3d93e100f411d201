"""The store's blocks: one record per block, where it lives, and the rules that move it.

`BlockManager` owns every `Block` and is the only writer of their fields; the store's protocol
(store.py) calls its verbs. Invariants:
- a key names at most one block (`_blocks` for block hashes, `_tails` for per-request tails);
- a block is pinned (pins > 0) while its writer has not committed it, while a lease holds it,
  and (a tail) until its TTL lapses; pinned blocks are never evicted nor moved, so a lease
  may keep `Block` objects;
- a tier's eviction order holds exactly its committed, unpinned, non-tail blocks: first the
  copies their writers keep (oldest first), then the rest (least recently used first);
- eviction from the device tier demotes to DRAM (dropping DRAM's first to evict when it is full,
  or the block itself when DRAM has no room at all); eviction from DRAM drops, handing the
  block to the tier below (`below`: the cluster) first when there is one, unless its writer
  keeps a copy (the writer hands it back when its own cache lets it go: services/prefill/
  offloader.py) or it came from the tier below: what goes below is what no cache above holds;
- a DRAM hit is promoted to the device tier when its last reader lets go;
- a slot whose writer may still land bytes in it (its write lease ended uncommitted) is fenced:
  quarantined until `fence_s` has passed, then free (docs/architecture.md says why);
- a block whose bytes fail their checksum is detached: out of every index and order at once,
  its slot freed when its last pin goes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.errors import ResourceExhausted
from pdserve.kv.checksum import checksum_of
from services.kvstore.events import IndexSink
from services.kvstore.memory import TierMemory

DEVICE, DRAM = "device", "dram"


@dataclass(slots=True, eq=False)
class Block:
    key: bytes  # block hash (16 bytes) or b"tail:" + the request's tail key
    tier: str
    slot: int
    pins: int = 1  # born pinned by its writer
    committed: bool = False
    writer_copy: bool = False  # its writer keeps a copy in its own cache: evicted first
    is_tail: bool = False
    checksum: int = 0  # the writer's xxh3-64 of the bytes, set at commit
    promote: bool = False  # a DRAM hit: promoted to the device tier once its last reader lets go
    detached: bool = False  # failed its checksum: in no index or order, its slot freed when unpinned
    from_below: bool = False  # fetched from the tier below, which still holds it: never written there again


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    tier_hits: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, DRAM: 0})
    evictions: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, DRAM: 0})
    promotions: int = 0
    corrupt: int = 0


class _Order:
    """One tier's eviction order: copies (oldest first), then the rest (least recently used first)."""

    def __init__(self) -> None:
        self.copies: OrderedDict[bytes, Block] = OrderedDict()
        self.rest: OrderedDict[bytes, Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self.copies) + len(self.rest)

    def add(self, b: Block) -> None:  # at the recent end of its queue
        (self.copies if b.writer_copy else self.rest)[b.key] = b

    def remove(self, b: Block) -> None:
        (self.copies if b.writer_copy else self.rest).pop(b.key, None)

    def pop_first(self) -> Block:
        return (self.copies or self.rest).popitem(last=False)[1]

    def keys(self) -> list[bytes]:
        return [*self.copies, *self.rest]


class BlockManager:
    """Owns the blocks, each tier's memory, eviction order and quarantine. Tells `index` where
    committed blocks go; counts in `counters`."""

    def __init__(self, device: TierMemory, dram: TierMemory, index: IndexSink, counters: Counters,
                 fence_s: float, clock: Callable[[], float],
                 below: Callable[[bytes, int, torch.Tensor], None] | None = None):
        self.tiers = {DEVICE: device, DRAM: dram}
        self.block_nbytes = device.block_nbytes
        self.index = index
        self.counters = counters
        self.fence_s = fence_s
        self.clock = clock
        self.below = below  # (key, checksum, bytes) of each committed block evicted from the last tier
        self._blocks: dict[bytes, Block] = {}
        self._tails: dict[bytes, Block] = {}
        self._orders = {DEVICE: _Order(), DRAM: _Order()}
        self._fenced: deque[tuple[float, str, int]] = deque()  # (free after, tier, slot), oldest first

    # -- looking -----------------------------------------------------------------------------
    def get(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def tail(self, key: bytes) -> Block | None:
        return self._tails.get(key)

    def address(self, b: Block) -> int:
        return self.tiers[b.tier].address(b.slot)

    def view(self, b: Block):
        return self.tiers[b.tier].view(b.slot)

    def order(self, tier: str) -> list[bytes]:
        """The tier's evictable blocks, first to evict first."""
        return self._orders[tier].keys()

    def blocks(self) -> list[Block]:
        return [*self._blocks.values(), *self._tails.values()]

    def room(self, tier: str) -> int:
        return self.tiers[tier].allocator.num_free + len(self._orders[tier])

    def num_fenced(self) -> int:
        return len(self._fenced)

    def verify(self, b: Block) -> bool:
        """Do the stored bytes still match the writer's checksum?"""
        return checksum_of(self.view(b)) == b.checksum

    # -- placing -----------------------------------------------------------------------------
    def allocate(self, keys: list[bytes], writer_copy: bool, tail_key: bytes | None) -> list[Block]:
        """New uncommitted blocks, pinned by their writer, for `keys` (none here) and the tail:
        device tier first, the rest spilled to DRAM; all or nothing. Evicts as needed."""
        n = len(keys) + (tail_key is not None)
        room_dev, room_dram = self.room(DEVICE), self.room(DRAM)
        if n > room_dev + room_dram:
            raise ResourceExhausted(f"store full: {n} blocks requested, {room_dev + room_dram} can be made free "
                                    f"(the rest are pinned by readers or writers); retry later")
        device, dram = self.tiers[DEVICE].allocator, self.tiers[DRAM].allocator
        n_dev = min(n, room_dev)
        while device.num_free < n_dev:
            self._evict_device()
        while dram.num_free < n - n_dev:
            self._drop_first(DRAM)
        slots = [(DEVICE, s) for s in device.allocate(n_dev).tolist()]
        slots += [(DRAM, s) for s in dram.allocate(n - n_dev).tolist()]
        out = [Block(k, tier, slot, writer_copy=writer_copy) for k, (tier, slot) in zip(keys, slots, strict=False)]
        for b in out:
            self._blocks[b.key] = b
        if tail_key is not None:
            tier, slot = slots[-1]
            tail = Block(tail_key, tier, slot, is_tail=True)
            self._tails[tail_key] = tail
            out.append(tail)
        return out

    def _evict_device(self) -> None:
        """The device tier's first to evict goes to DRAM (or is dropped when DRAM has no room)."""
        self.counters.evictions[DEVICE] += 1
        if self.room(DRAM) == 0:
            self._leave(self._orders[DEVICE].pop_first())
            return
        if self.tiers[DRAM].allocator.num_free == 0:
            self._drop_first(DRAM)
        victim = self._orders[DEVICE].pop_first()
        [slot] = self.tiers[DRAM].allocator.allocate(1).tolist()
        self._move(victim, DRAM, slot)

    def _drop_first(self, tier: str) -> None:
        self.counters.evictions[tier] += 1
        self._leave(self._orders[tier].pop_first())

    def _leave(self, b: Block) -> None:
        """An evicted block out of the last local tier: to the tier below (if any, and only what no
        cache above holds), then dropped."""
        if self.below is not None and not (b.writer_copy or b.from_below):
            self.below(b.key, b.checksum, self.view(b))
        self._drop(b)

    def _move(self, b: Block, tier: str, slot: int) -> None:
        """Copy an unpinned committed block (out of its order) to a free slot of `tier`, and
        verify the copy: a block that fails its checksum is dropped, not moved."""
        old = self.tiers[b.tier]
        self.tiers[tier].view(slot).copy_(old.view(b.slot))
        old.allocator.free(b.slot)
        b.tier, b.slot = tier, slot
        if not self.verify(b):
            self.counters.corrupt += 1
            self._drop(b)
            return
        self._orders[tier].add(b)
        self.index.moved(b.key, tier)

    def _forget(self, b: Block) -> None:
        """Out of the index: no one finds it by its key again (the Redis index hears of it)."""
        if b.is_tail:
            self._tails.pop(b.key, None)
        elif self._blocks.get(b.key) is b:
            del self._blocks[b.key]
            if b.committed:
                self.index.dropped(b.key)

    def _drop(self, b: Block) -> None:
        """Forget a block that is out of every order, and free its slot."""
        self._forget(b)
        self.tiers[b.tier].allocator.free(b.slot)

    # -- pins, commits, use ------------------------------------------------------------------
    def pin(self, blocks: Iterable[Block], for_read: bool = False) -> int:
        """One more pin each (out of its eviction order). for_read: a DRAM hit is promoted once
        its last reader lets go. Returns how many were DRAM hits."""
        n_dram = 0
        for b in blocks:
            if b.pins == 0 and b.committed and not b.is_tail:
                self._orders[b.tier].remove(b)
            b.pins += 1
            if for_read and b.tier == DRAM:
                b.promote = True
                n_dram += 1
        return n_dram

    def unpin(self, blocks: Iterable[Block]) -> None:
        """One pin less each; one no longer pinned is evictable again (at the recent end), a
        tail goes, a detached block's slot is freed, and a DRAM hit is promoted."""
        for b in blocks:
            b.pins -= 1
            if b.pins:
                continue
            if b.detached:
                self.tiers[b.tier].allocator.free(b.slot)
            elif b.is_tail:
                self._drop(b)
            elif b.committed:
                self._orders[b.tier].add(b)
                if b.promote:
                    b.promote = False
                    self._promote(b)

    def commit(self, blocks: Iterable[Block], checksums: Iterable[int]) -> None:
        """Written: readable now, with their writer's checksums. The writer's pin goes (a tail's
        becomes its TTL pin)."""
        for b, checksum in zip(blocks, checksums, strict=True):
            b.committed, b.checksum = True, checksum
            if b.is_tail:
                continue
            self.index.committed([b.key], [b.tier])
            self.unpin([b])

    def adopt(self, keys: Sequence[bytes], checksums: Sequence[int], data: Sequence[torch.Tensor]) -> int:
        """Verified blocks from the tier below, in order: into local slots (as far as room goes),
        committed, the store's own. A key already here ends the run. Returns how many."""
        n = 0
        while n < len(keys) and self._blocks.get(keys[n]) is None:
            n += 1
        n = min(n, self.room(DEVICE) + self.room(DRAM))
        if not n:
            return 0
        new = self.allocate(list(keys[:n]), writer_copy=False, tail_key=None)
        for b, src in zip(new, data, strict=False):
            self.view(b).copy_(src)
            b.from_below = True
        self.commit(new, checksums[:n])
        return n

    def keep(self, blocks: Iterable[Block]) -> None:
        """Committed blocks a put found here: the store's own now (no longer copies their
        writer keeps) and most recently used."""
        for b in blocks:
            queued = b.pins == 0
            if queued:
                self._orders[b.tier].remove(b)
            b.writer_copy = False
            if queued:
                self._orders[b.tier].add(b)

    def fence(self, blocks: Iterable[Block]) -> int:
        """Uncommitted blocks whose writer gave up or lapsed: out of the index (another writer
        may put them again), their slots quarantined for `fence_s`. Returns how many."""
        until = self.clock() + self.fence_s
        n = 0
        for b in blocks:
            self._forget(b)
            b.detached, b.pins = True, 0
            self._fenced.append((until, b.tier, b.slot))
            n += 1
        return n

    def drop_unwritten(self, blocks: Iterable[Block]) -> int:
        """Uncommitted blocks no one can still be writing (the store's own failed write): gone now."""
        n = 0
        for b in blocks:
            b.pins = 0
            self._drop(b)
            n += 1
        return n

    def reap_fenced(self) -> int:
        """Free the quarantined slots whose time is up; returns how many."""
        now, n = self.clock(), 0
        while self._fenced and self._fenced[0][0] <= now:
            _, tier, slot = self._fenced.popleft()
            self.tiers[tier].allocator.free(slot)
            n += 1
        return n

    def detach(self, b: Block) -> None:
        """A committed block whose bytes failed their checksum: never found again; its slot is
        freed once its last pin goes (at once when it has none)."""
        if b.detached:
            return
        self.counters.corrupt += 1
        if b.pins == 0 and not b.is_tail:
            self._orders[b.tier].remove(b)
        self._forget(b)
        b.detached = True
        if b.pins == 0:
            self.tiers[b.tier].allocator.free(b.slot)

    def _promote(self, b: Block) -> None:
        """An unpinned DRAM block (just queued) to the device tier: to a free slot, or in a swap
        with the device's first to evict."""
        device = self.tiers[DEVICE].allocator
        if self.room(DEVICE) == 0:
            return
        self.counters.promotions += 1
        self._orders[DRAM].remove(b)
        if device.num_free:
            [slot] = device.allocate(1).tolist()
            self._move(b, DEVICE, slot)
            return
        victim = self._orders[DEVICE].pop_first()
        self.counters.evictions[DEVICE] += 1
        ours = self.view(b).clone()
        self.view(b).copy_(self.view(victim))
        self.view(victim).copy_(ours)
        (b.slot, b.tier), (victim.slot, victim.tier) = (victim.slot, DEVICE), (b.slot, DRAM)
        for moved in (victim, b):
            if self.verify(moved):
                self._orders[moved.tier].add(moved)
                self.index.moved(moved.key, moved.tier)
            else:
                self.counters.corrupt += 1
                self._drop(moved)
