"""The store's records: slot references, leases, watchers, counters (the blocks themselves are
columns: table.py)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

DEVICE, DRAM = "device", "dram"
TIER_CODE = {DEVICE: 1, DRAM: 2}  # a tier as one byte (Slots.tier_codes)
TIER_NAME = {code: name for name, code in TIER_CODE.items()}
NO_ROWS = np.empty(0, np.int64)  # no block ids (never changed in place: arrays are replaced)
NO_ROWS.flags.writeable = False


class SlotState(enum.IntEnum):  # int-valued: hashed and compared at C speed, per block
    WRITE = 1
    PRESENT = 2
    PENDING = 3


class SlotRef(NamedTuple):  # one block's slot (a tail, a watched block); calls answer `Slots`
    key: bytes
    row: int  # its block id (see table.py): true while it stays pinned
    address: int
    tier: str
    state: SlotState


@dataclass(slots=True)
class Slots:
    """The slots of one call's blocks, as columns (entry i is block i): a put or get of
    hundreds of blocks builds them, and they go out, without an object per block. The one-byte
    columns are bytes, as they go out."""

    rows: np.ndarray  # int64 block ids (see table.py): true while the call's lease pins them
    addresses: np.ndarray  # little-endian uint64
    tier_codes: bytes  # TIER_CODE[tier] per block
    states: bytes  # a SlotState value per block

    @classmethod
    def of(cls, refs: list[SlotRef]) -> Slots:
        return cls(np.array([r.row for r in refs], np.int64), np.array([r.address for r in refs], "<u8"),
                   bytes(TIER_CODE[r.tier] for r in refs), bytes(r.state for r in refs))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def tiers(self) -> list[str]:
        return [TIER_NAME[c] for c in self.tier_codes]


@dataclass
class Lease:
    lease_id: str
    kind: str  # "read" | "write" | "hold" (a handoff's blocks, pinned for the request's reader)
    deadline: float
    request_id: str
    # int64 block ids; read: those it pins; write: those still uncommitted
    pinned: np.ndarray = field(default_factory=lambda: NO_ROWS)
    named: np.ndarray | None = None  # write: the hashes the put named, packed (see table.py)
    tail_key: bytes | None = None  # write: the put's tail, if any; read: the tail it pins, if any
    all_keys: set[bytes] | None = None  # write: `named` and the tail as a set, made when a commit names keys
    watching: bool = False  # a live Watch stream keeps it from lapsing
    hold_id: str = ""  # write: the hold on this put's blocks, if any
    held: np.ndarray | None = None  # hold: the block ids it pinned
    held_keys: np.ndarray | None = None  # hold: their hashes, packed (a block gone since is skipped)
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
