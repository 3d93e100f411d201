"""The store's records: entries (one per block), slot references, leases, watchers, counters."""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
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


class EvictionOrder:
    """One tier's committed, unpinned, non-tail blocks in the order they would be evicted: first
    the copies their writers keep in their own caches (oldest first), then the rest, least
    recently used first."""

    def __init__(self) -> None:
        self._copies: OrderedDict[bytes, None] = OrderedDict()
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._copies) + len(self._lru)

    def add(self, entry: Entry) -> None:
        (self._copies if entry.duplicate else self._lru)[entry.key] = None

    def discard(self, key: bytes) -> None:
        self._copies.pop(key, None)
        self._lru.pop(key, None)

    def touch(self, key: bytes) -> None:
        """Most recently used now (a copy stays in the copies' order)."""
        if key in self._lru:
            self._lru.move_to_end(key)

    def pop_first(self) -> bytes:
        return (self._copies or self._lru).popitem(last=False)[0]


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
    pinned: list[bytes] = field(default_factory=list)  # read: keys pinned; write: keys still uncommitted
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
