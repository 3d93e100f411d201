"""The store's records: entries (one per block), slot references, leases, watchers, counters."""

from __future__ import annotations

import asyncio
import enum
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

DEVICE, DRAM = "device", "dram"


class SlotState(enum.IntEnum):  # int-valued: hashed and compared at C speed, per block
    WRITE = 1
    PRESENT = 2
    PENDING = 3


@dataclass(slots=True)
class Entry:
    key: bytes
    tier: str
    slot: int
    pins: int = 0
    # Its writer keeps a copy in its own cache: when unpinned it goes to the LRU's cold end (the
    # first to evict), not the recent one; an offload of the same block clears this.
    duplicate: bool = False
    committed: bool = False
    is_tail: bool = False
    tail_held: bool = False  # a committed tail is pinned by its TTL until tail_expires
    tail_expires: float = 0.0
    promote_on_release: bool = False
    order_stamp: int = 0  # its item in its tier's EvictionOrder; 0: in none (pinned, uncommitted, a tail)
    # The block written after it by the same put (its likely successor in a get's chain, found
    # without a look-up), and whether it was dropped since (then it is no successor of anything).
    next: Entry | None = None
    dropped: bool = False


class EvictionOrder:
    """One tier's committed, unpinned, non-tail blocks in the order they would be evicted: first
    the copies their writers keep in their own caches (oldest first), then the rest, least
    recently used first.

    Two append-only queues with lazy deletion: adding or touching an entry appends it with a
    fresh stamp, discarding clears the entry's stamp, and a queued item counts while its entry
    still bears its stamp. So each step touches the entry alone (no hashing, no list nodes: a
    get or commit of a thousand blocks made as many dict and node operations before), and dead
    items are shed from the head as it is popped, or all at once when they outnumber the live."""

    def __init__(self) -> None:
        self._items: tuple[list[Entry], list[Entry]] = ([], [])  # copies, the rest
        self._stamps: tuple[list[int], list[int]] = ([], [])  # each item's stamp when queued
        self._heads = [0, 0]  # items before these are popped
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def add(self, entry: Entry) -> None:
        if entry.order_stamp:
            return  # in the order already: it keeps its place
        self._queue(entry, 0 if entry.duplicate else 1)
        self._live += 1

    def discard(self, entry: Entry) -> None:
        if entry.order_stamp:
            entry.order_stamp = 0
            self._live -= 1

    def discard_all(self, entries: list[Entry]) -> None:
        for entry in entries:
            if entry.order_stamp:
                entry.order_stamp = 0
                self._live -= 1

    def touch(self, entry: Entry) -> None:
        """Most recently used now (a copy stays in the copies' order)."""
        if entry.order_stamp and not entry.duplicate:
            self._queue(entry, 1)

    def pop_first(self) -> Entry:
        for q in (0, 1):
            items, stamps, head = self._items[q], self._stamps[q], self._heads[q]
            while head < len(items):
                entry, stamp = items[head], stamps[head]
                head += 1
                if entry.order_stamp == stamp:
                    self._heads[q] = head
                    entry.order_stamp = 0
                    self._live -= 1
                    return entry
            del items[:], stamps[:]
            self._heads[q] = 0
        raise KeyError("eviction order is empty")

    def _queue(self, entry: Entry, q: int) -> None:
        entry.order_stamp = stamp = next(_STAMPS)
        self._items[q].append(entry)
        self._stamps[q].append(stamp)
        if len(self._items[q]) > 2 * self._live + SHED_AFTER:  # mostly dead: keep the live only
            self._compact()

    def _compact(self) -> None:
        for q in (0, 1):
            items, stamps, head = self._items[q], self._stamps[q], self._heads[q]
            live = [i for i in range(head, len(items)) if items[i].order_stamp == stamps[i]]
            items[:] = [items[i] for i in live]
            stamps[:] = [stamps[i] for i in live]
            self._heads[q] = 0


SHED_AFTER = 1024  # dead items an order may hold beyond as many as its live ones
_STAMPS = itertools.count(1)  # one sequence for every order: an entry moved between tiers keeps no stale item live


class SlotRef(NamedTuple):  # one block's slot (a tail, a watched block); calls answer `Slots`
    key: bytes
    address: int
    tier: str
    state: SlotState


@dataclass(slots=True)
class Slots:
    """The slots of one call's blocks, as columns (row i is block i): a put or get of hundreds
    of blocks builds them without an object per block, and they go out as columns too."""

    keys: list[bytes]
    addresses: list[int]
    tiers: list[str]
    states: list[SlotState]

    @classmethod
    def of(cls, refs: list[SlotRef]) -> Slots:
        if not refs:
            return cls([], [], [], [])
        keys, addresses, tiers, states = map(list, zip(*refs, strict=True))
        return cls(keys, addresses, tiers, states)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> SlotRef:
        return SlotRef(self.keys[i], self.addresses[i], self.tiers[i], self.states[i])


@dataclass
class Lease:
    lease_id: str
    kind: str  # "read" | "write" | "hold" (a handoff's blocks, pinned for the request's reader)
    deadline: float
    request_id: str
    pinned: list[Entry] = field(default_factory=list)  # read: the entries it pins; write: those still uncommitted
    all_keys: set[bytes] = field(default_factory=set)  # write: every key the put named
    watching: bool = False  # a live Watch stream keeps it from lapsing
    hold_id: str = ""  # write: the hold on this put's blocks, if any
    held: list[Entry] = field(default_factory=list)  # hold: the entries it pinned (a dropped one is skipped)
    hold_s: float = 0.0  # hold: how long it outlives the put's last commit


@dataclass
class Watcher:
    lease: Lease
    wanted: dict[bytes, int]  # key -> index in the request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    tier_hits: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, DRAM: 0})
    evictions: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, DRAM: 0})
    promotions: int = 0
