"""The store's blocks as columns: one row per slot, across both tiers.

A block's id is its slot's row: device slots are rows [0, D), DRAM slots rows [D, D + R). A
block that moves between tiers changes id; a pinned block never moves, so a lease may hold ids.
A call of a thousand blocks then sets a column's rows in one numpy step instead of making and
touching a thousand objects (≈ 185 ns to make each one here, more than the rest of a put).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from pdserve.kv.hashing import HASH_BYTES
from pdserve.wire import hashes_to_pb
from services.kvstore.block_index import NativeBlockIndex, as_rows, library, make_index
from services.kvstore.entries import DEVICE, DRAM, TIER_CODE, Slots
from services.kvstore.memory import TierMemory

NO_BLOCK = -1


def pack(hashes: np.ndarray | Sequence[bytes]) -> np.ndarray:
    """Block hashes as the store keeps them: [n, 2] uint64, each hash's 16 bytes (an array
    already so passes as it is)."""
    if isinstance(hashes, np.ndarray):
        return hashes
    return np.frombuffer(hashes_to_pb(hashes), np.uint64).reshape(-1, 2)


def unpack(packed: np.ndarray) -> list[bytes]:
    """Packed hashes back as one bytes object each (for the paths that name blocks one by one)."""
    data = packed.tobytes()
    return [data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


class Hashes(Sequence[bytes]):
    """Packed hashes read as a sequence of bytes objects, each made when it is read: the store
    hands a commit's keys on like this, and its reader unpacks them off the call's path."""

    __slots__ = ("packed",)

    def __init__(self, packed: np.ndarray):
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return unpack(self.packed[i])
        return self.packed[i].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        return iter(unpack(self.packed))


class RowTiers(Sequence[str]):
    """Rows' tiers, each worked out when it is read (see `Hashes`)."""

    __slots__ = ("rows", "split")

    def __init__(self, rows: np.ndarray, split: int):
        self.rows, self.split = rows, split

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(RowTiers(self.rows[i], self.split))
        return DEVICE if self.rows[i] < self.split else DRAM

    def __iter__(self) -> Iterator[str]:
        split = self.split
        return (DEVICE if r < split else DRAM for r in self.rows.tolist())


class BlockView(NamedTuple):
    """One block's state, read out (for tests, stats and logs; calls work on the columns)."""

    key: bytes
    tier: str
    slot: int
    pins: int
    committed: bool
    duplicate: bool
    is_tail: bool
    promote_on_release: bool


class BlockTable:
    """Owns every block's row and the key -> row maps (block hashes: `index`; per-request tails:
    `tails`); `TieredBlocks` decides what goes where.

    Invariants: `row(k) == i` exactly when `key(i) == k`; a row with no block has every column
    clear (rows are cleared when their block goes, so a new block starts clean)."""

    def __init__(self, device: TierMemory, dram: TierMemory):
        self.split = device.info.num_slots  # first DRAM id
        n = self.split + dram.info.num_slots
        self.size = n
        self.index = make_index(n)  # block hash -> row
        self.tails: dict[bytes, int] = {}  # a per-request tail's key -> row
        self.tail_keys: dict[int, bytes] = {}  # and back
        # Each row's block hash, packed as the index takes them (a tail's row: zeros, its key is
        # in `tail_keys`): a call's keys go in and out as one numpy step, no object per block.
        self.keys = np.zeros((n, 2), np.uint64)
        self.pins = np.zeros(n, np.int32)
        self.committed = np.zeros(n, np.bool_)
        # Its writer keeps a copy in its own cache: when unpinned it goes to the cold end of its
        # tier's eviction order, not the recent one; an offload of the same block clears this.
        self.duplicate = np.zeros(n, np.bool_)
        self.is_tail = np.zeros(n, np.bool_)
        self.promote = np.zeros(n, np.bool_)  # a DRAM hit: promoted when its last reader lets go
        self.stamp = np.zeros(n, np.int64)  # its item in its tier's EvictionOrder; 0: in none
        # The last eviction-order stamp given: one sequence for both tiers' orders, so an item
        # left behind by a block that moved or went never matches its row again.
        self._stamps = 0
        # A call's rows are pinned, unpinned and committed in one C loop (csrc/block_rows.c, in
        # the index's library; numpy where that could not be built). The columns never move.
        self._lib = library() if isinstance(self.index, NativeBlockIndex) else None
        # The C loops' answers: freed rows, the four groups of `queue` (4 x a call's rows), counts.
        self._freed, self._groups = np.empty(max(n, 1), np.int64), np.empty(4 * max(n, 1), np.int64)
        self._counts = np.empty(5, np.int64)
        self._columns = {name: getattr(self, name).ctypes.data for name in (
            "keys", "pins", "committed", "duplicate", "is_tail", "promote", "stamp", "_freed", "_groups", "_counts")}
        nbytes = device.block_nbytes
        step = np.uint64(nbytes)
        self.address = np.concatenate([  # little-endian uint64 (as answers carry them): device and host alike
            np.uint64(device.base_address) + np.arange(self.split, dtype=np.uint64) * step,
            np.uint64(dram.base_address) + np.arange(n - self.split, dtype=np.uint64) * step]).astype("<u8")
        codes = np.array([TIER_CODE[DEVICE], TIER_CODE[DRAM]], np.uint8)
        self.tier_code = np.repeat(codes, [self.split, n - self.split])  # each row's tier, as one byte

    def __contains__(self, key: bytes) -> bool:
        return self.row(key) != NO_BLOCK

    def __len__(self) -> int:
        return len(self.index) + len(self.tails)

    def row(self, key: bytes) -> int:
        """The row of a block hash or a tail key; NO_BLOCK when not here."""
        row = self.tails.get(key, NO_BLOCK)
        if row == NO_BLOCK and len(key) == HASH_BYTES:
            row = int(self.index.lookup(pack([key]))[0])
        return row

    def key(self, block_id: int) -> bytes | None:
        """The key of the block in a row (its hash, or a tail's key); None when the row holds none."""
        if self.is_tail[block_id]:
            return self.tail_keys[block_id]
        packed = self.keys[block_id : block_id + 1]
        return packed.tobytes() if self.index.lookup(packed)[0] == block_id else None

    def tier_of(self, block_id: int) -> str:
        return DEVICE if block_id < self.split else DRAM

    def slot_of(self, block_id: int) -> int:
        return block_id if block_id < self.split else block_id - self.split

    def id_of(self, tier: str, slot: int) -> int:
        return slot if tier == DEVICE else self.split + slot

    def tier_range(self, tier: str) -> slice:
        return slice(0, self.split) if tier == DEVICE else slice(self.split, self.size)

    def slots(self, block_ids: np.ndarray, states: bytes) -> Slots:
        """The answer's columns for these rows."""
        return Slots(block_ids, self.address[block_ids], self.tier_code[block_ids].tobytes(), states)

    def tiers_of(self, block_ids: np.ndarray) -> Sequence[str]:
        """Each row's tier, worked out as it is read (a commit hands them on to the index like this)."""
        return RowTiers(block_ids, self.split)

    def pin(self, block_ids: np.ndarray, for_read: bool) -> tuple[int, int, int]:
        """One more pin on each row; a row queued in an eviction order leaves it. for_read: a
        DRAM row that is no tail is marked for promotion. Returns (rows that left the device
        order, rows that left the DRAM order, rows marked)."""
        if self._lib is not None:
            rows, c = as_rows(block_ids), self._columns
            self._lib.rows_pin(rows, len(rows), c["pins"], c["stamp"], self.split, c["is_tail"],
                               c["promote"] if for_read else None, c["_counts"])
            left_device, left_dram, marked = self._counts[:3].tolist()
            return left_device, left_dram, marked
        queued = block_ids[self.stamp[block_ids] != 0]
        self.stamp[queued] = 0
        left_dram = int(np.count_nonzero(queued >= self.split))
        self.pins[block_ids] += 1
        marked = 0
        if for_read:
            dram = block_ids[(block_ids >= self.split) & ~self.is_tail[block_ids]]
            self.promote[dram] = True
            marked = len(dram)
        return len(queued) - left_dram, left_dram, marked

    def commit_and_queue(self, block_ids: np.ndarray) -> tuple[list[np.ndarray], int]:
        """Committed, and the writer's pin let go; the rows left with no pin are stamped for the
        recent end of their eviction orders and returned as `queue` returns them."""
        if self._lib is None:
            self.committed[block_ids] = True
            self.pins[block_ids] -= 1
            return self.queue(block_ids[self.pins[block_ids] == 0])
        rows, n, c, first = as_rows(block_ids), len(block_ids), self._columns, self._stamps + 1
        queued = self._lib.rows_commit_queue(rows, n, c["committed"], c["pins"], c["stamp"],
                                             c["duplicate"], self.split, first, c["_freed"], c["_groups"], c["_counts"])
        self._stamps += queued
        return self._groups_of(queued), first  # (every row freed is queued: a pinned row is in no order)

    def unpin_and_queue(self, block_ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray] | None, int]:
        """One pin less on each row. When none of the rows left with no pin is a tail,
        uncommitted or marked for promotion (a plain release), they are stamped for the recent
        end of their orders and returned as `queue` returns them (as the 2nd and 3rd values);
        otherwise nothing is queued and the 1st value is those rows, in order (2nd: None)."""
        if self._lib is None:
            if len(block_ids) and self.pins[block_ids].min() <= 0:
                raise AssertionError(f"unpinned below zero: {block_ids[self.pins[block_ids] <= 0].tolist()}")
            self.pins[block_ids] -= 1
            freed = block_ids[self.pins[block_ids] == 0]
            if (self.is_tail[freed] | ~self.committed[freed] | self.promote[freed]).any():
                return freed, None, 0
            return freed, *self.queue(freed)
        rows, n, c, first = as_rows(block_ids), len(block_ids), self._columns, self._stamps + 1
        m = self._lib.rows_unpin_queue(rows, n, c["pins"], c["is_tail"], c["committed"], c["promote"],
                                       c["stamp"], c["duplicate"], self.split, first, c["_freed"], c["_groups"],
                                       c["_counts"])
        if m < 0:
            raise AssertionError(f"unpinned below zero: row {rows[-m - 1]} ({self.key(rows[-m - 1])!r})")
        if not self._counts[4]:
            return self._freed[:m].copy(), None, 0
        self._stamps += m  # (every row freed is queued: a pinned row is in no order)
        return self._freed[:m], self._groups_of(m), first

    def queue(self, block_ids: np.ndarray) -> tuple[list[np.ndarray], int]:
        """Stamp the rows that are in no eviction order, for the recent end of theirs. Returns
        them by group, in order (device copies, the device's others, DRAM copies, DRAM's
        others; a copy: a block its writer keeps), stamped group after group from the second
        value returned on. (The groups may be the table's buffer: copy what is kept.)"""
        first = self._stamps + 1
        if self._lib is not None:
            rows, n, c = as_rows(block_ids), len(block_ids), self._columns
            self._stamps += self._lib.rows_queue(rows, n, c["stamp"], c["duplicate"], self.split, first,
                                                 c["_groups"], c["_counts"])
            return self._groups_of(n), first
        fresh = block_ids[self.stamp[block_ids] == 0]
        in_dram, copy = fresh >= self.split, self.duplicate[fresh]
        groups = [fresh[~in_dram & copy], fresh[~in_dram & ~copy], fresh[in_dram & copy], fresh[in_dram & ~copy]]
        self.stamp[np.concatenate(groups)] = np.arange(first, first + len(fresh), dtype=np.int64)
        self._stamps += len(fresh)
        return groups, first

    def _groups_of(self, n: int) -> list[np.ndarray]:
        """The four groups the last C loop wrote, n places apart."""
        counts = self._counts[:4].tolist()
        return [self._groups[g * n : g * n + counts[g]] for g in range(4)]

    def add(self, packed: np.ndarray, block_ids: np.ndarray, pins: int, duplicate: bool,
            tail_key: bytes | None = None) -> None:
        """New blocks, uncommitted, in rows that hold none: the hashes `packed`, then the tail
        (the last row) if any."""
        n = len(packed)
        if self._lib is not None:  # the index, and the rows' keys, pins and copy flags, in one C pass
            c = self._columns
            self.index.insert(packed, block_ids[:n], (c["keys"], c["pins"], pins, c["duplicate"], duplicate))
        else:
            self.index.insert(packed, block_ids[:n])
            self.keys[block_ids[:n]] = packed
            self.pins[block_ids[:n]] = pins
            if duplicate:
                self.duplicate[block_ids[:n]] = True
        if tail_key is not None:
            row = int(block_ids[n])
            self.tails[tail_key], self.tail_keys[row] = row, tail_key
            self.is_tail[row] = True
            self.pins[row] = pins
            if duplicate:
                self.duplicate[row] = True

    def clear(self, block_ids: np.ndarray) -> None:
        """Forget the blocks in these rows."""
        tails = self.is_tail[block_ids]
        if tails.any():
            for i in block_ids[tails].tolist():
                del self.tails[self.tail_keys.pop(i)]
            self.index.remove(self.keys[block_ids[~tails]])
        else:
            self.index.remove(self.keys[block_ids])
        for column in (self.keys, self.pins, self.committed, self.duplicate, self.is_tail, self.promote, self.stamp):
            column[block_ids] = 0

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """The blocks in rows `src` now live in rows `dst` (empty ones): every column follows
        (the eviction-order stamp too: the caller queues them again where they now are). Only
        evictable blocks move: never a tail."""
        self.index.update(self.keys[src], dst)
        for column in (self.keys, self.pins, self.committed, self.duplicate, self.is_tail, self.promote):
            column[dst] = column[src]
            column[src] = 0
        self.stamp[src] = 0

    def swap(self, a: int, b: int) -> None:
        """The blocks in rows a and b trade places (a promotion into a full device tier; never tails)."""
        for column in (self.keys, self.pins, self.committed, self.duplicate, self.is_tail, self.promote, self.stamp):
            column[[a, b]] = column[[b, a]]
        self.index.update(self.keys[[a, b]], np.array([a, b], np.int64))

    def view(self, key: bytes) -> BlockView:
        i = self.row(key)
        if i == NO_BLOCK:
            raise KeyError(key)
        return BlockView(key, self.tier_of(i), self.slot_of(i), int(self.pins[i]), bool(self.committed[i]),
                         bool(self.duplicate[i]), bool(self.is_tail[i]), bool(self.promote[i]))
