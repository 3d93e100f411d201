"""The store's records: slot references, leases, watchers, counters (the blocks themselves are
columns: table.py)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

DEVICE, DRAM = "device", "dram"


class SlotState(enum.IntEnum):  # int-valued: hashed and compared at C speed, per block
    WRITE = 1
    PRESENT = 2
    PENDING = 3


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
    pinned: list[int] = field(default_factory=list)  # read: the block ids it pins; write: those still uncommitted
    named: list[bytes] = field(default_factory=list)  # write: every key the put named, the tail last
    tail_key: bytes | None = None  # write: the put's tail, if any; read: the tail it pins, if any
    all_keys: set[bytes] | None = None  # write: `named` as a set, made when a commit names keys
    watching: bool = False  # a live Watch stream keeps it from lapsing
    hold_id: str = ""  # write: the hold on this put's blocks, if any
    held: list[int] = field(default_factory=list)  # hold: the block ids it pinned
    held_keys: list[bytes] = field(default_factory=list)  # hold: theirs (a block gone since is skipped)
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
