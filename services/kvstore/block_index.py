"""The store's index of block hashes: 16-byte key -> block row (see table.py).

A call's keys go in and out as one array [n, 2] of uint64 (two words per hash), so a put or get
of a thousand blocks is one C call (csrc/block_index.c, built on first use: pdserve/native.py)
instead of a thousand dict operations on bytes objects, each a cache miss or two in an index of
hundreds of thousands of blocks. Where no C compiler is found, the same interface over a dict,
with a warning in the log.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np

from pdserve import logs
from pdserve.native import NativeUnavailable, build_module

log = logs.get("kvstore.index")

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("block_index.c", "block_rows.c", "module.c")]
_NONE = -1
_OUT_OF_MEMORY = -(2**63)  # block_index_lookup_unique's INT64_MIN


class BlockIndex(Protocol):
    """Keys [n, 2] uint64 (each hash's 16 bytes), rows int64."""

    def __len__(self) -> int: ...

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Each key's row, or -1."""

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Keys not in the index, none repeated."""

    def update(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Keys in the index: their new rows."""

    def remove(self, keys: np.ndarray) -> None:
        """Keys in the index."""

    def lookup_unique(self, keys: np.ndarray) -> tuple[np.ndarray, int] | None:
        """Each key's row (or -1) and how many are here, as one pass; None when a key repeats
        an earlier one."""

    def prefix(self, keys: np.ndarray, committed: np.ndarray) -> np.ndarray | None:
        """The rows of the longest prefix of keys whose blocks are here and committed; None when
        a key repeats an earlier one of that prefix."""


@functools.cache
def library() -> ModuleType:
    """The store's C functions (this index, and the table's row loops: csrc/block_rows.c), as the
    extension module csrc/module.c makes of them (see there for how arguments are passed)."""
    return build_module("_kvstore", SOURCES, ["-O2", "-fPIC", "-std=gnu11"])


def _places(n: int) -> int:
    """A table of at least twice n places, a power of two (probes stay short)."""
    return max(16, 1 << (2 * max(n, 1) - 1).bit_length())


def as_keys(keys: np.ndarray) -> np.ndarray:
    """Keys as the C functions read them: C-contiguous uint64 (most are already: then as they are)."""
    return keys if keys.dtype == np.uint64 and keys.flags.c_contiguous else np.ascontiguousarray(keys, np.uint64)


def as_rows(rows: np.ndarray) -> np.ndarray:
    return rows if rows.dtype == np.int64 and rows.flags.c_contiguous else np.ascontiguousarray(rows, np.int64)


class NativeBlockIndex:
    """Owns its table; at most `capacity` keys at once."""

    def __init__(self, capacity: int):
        self._lib = library()
        places = _places(capacity)
        self._mask = places - 1
        self._keys = np.zeros((places, 2), np.uint64)
        self._rows = np.full(places, _NONE, np.int32)
        # The arrays never move: their addresses are taken once (each `.ctypes.data` costs a µs hot,
        # tens cold); a call's own arrays go to the C functions as buffers.
        self._table = (self._keys.ctypes.data, self._rows.ctypes.data, self._mask)
        self._marks = np.zeros(capacity, np.uint8)  # one per row, for `prefix`
        self._out = np.empty(max(capacity, 1), np.int64)  # answers are written here, then copied out
        self._buffers = (self._marks.ctypes.data, self._out.ctypes.data)
        self._count = 0
        self.capacity = capacity

    def __len__(self) -> int:
        return self._count

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        out, out_ptr = self._answer(len(keys))
        self._lib.block_index_lookup(as_keys(keys), len(keys), *self._table, out_ptr)
        return out[: len(keys)].copy()

    def _answer(self, n: int) -> tuple[np.ndarray, int]:
        """Where an answer of n rows is written: the index's own buffer (its address taken once),
        or, for more keys than the index holds, one of its own."""
        if n <= len(self._out):
            return self._out, self._buffers[1]
        out = np.empty(n, np.int64)
        return out, out

    def insert(self, keys: np.ndarray, rows: np.ndarray,
               columns: tuple[int, int, int, int, bool] | None = None) -> None:
        """With `columns`, the block table's columns for those rows are set in the same C pass:
        (its keys' address, its pins', the pin count to set, its copy flags', set them?)."""
        if self._count + len(keys) > self.capacity:
            raise RuntimeError(f"block index: {self._count} + {len(keys)} keys > capacity {self.capacity}")
        keys, rows = as_keys(keys), as_rows(rows)
        if columns is None:
            done = self._lib.block_index_insert(keys, rows, len(keys), *self._table)
        else:
            key_col, pins, pin, dup_col, dup = columns
            done = self._lib.block_index_add_rows(keys, rows, len(keys), *self._table, key_col, pins, pin, dup_col,
                                                  int(dup))
        self._count += done
        if done != len(keys):
            raise RuntimeError(f"block index: key {done} of an insert is already indexed")

    def update(self, keys: np.ndarray, rows: np.ndarray) -> None:
        missing = self._lib.block_index_update(as_keys(keys), as_rows(rows), len(keys), *self._table)
        if missing:
            raise RuntimeError(f"block index: {missing} keys to update are not indexed")

    def remove(self, keys: np.ndarray) -> None:
        missing = self._lib.block_index_remove(as_keys(keys), len(keys), *self._table)
        self._count -= len(keys) - missing
        if missing:
            raise RuntimeError(f"block index: {missing} keys to remove are not indexed")

    def lookup_unique(self, keys: np.ndarray) -> tuple[np.ndarray, int] | None:
        out, out_ptr = self._answer(len(keys))
        found = self._lib.block_index_lookup_unique(as_keys(keys), len(keys), *self._table, out_ptr)
        if found == _OUT_OF_MEMORY:
            raise MemoryError(f"block index: no memory to look for repeats among {len(keys)} keys")
        return (out[: len(keys)].copy(), found) if found >= 0 else None

    def prefix(self, keys: np.ndarray, committed: np.ndarray) -> np.ndarray | None:
        out, out_ptr = self._answer(len(keys))
        n = self._lib.block_index_prefix(as_keys(keys), len(keys), *self._table, committed, self._buffers[0], out_ptr)
        return out[:n].copy() if n >= 0 else None


class DictBlockIndex:
    """The same over a dict of bytes (where nothing can be compiled; and a reference in tests)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._rows: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def _split(keys: np.ndarray) -> list[bytes]:
        data = np.ascontiguousarray(keys, np.uint64).tobytes()
        return [data[i : i + 16] for i in range(0, len(data), 16)]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        get = self._rows.get
        return np.array([get(k, _NONE) for k in self._split(keys)], np.int64)

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        split = self._split(keys)
        if len(self._rows) + len(split) > self.capacity:
            raise RuntimeError(f"block index: {len(self._rows)} + {len(split)} keys > capacity {self.capacity}")
        for i, (key, row) in enumerate(zip(split, rows.tolist(), strict=True)):
            if key in self._rows:
                raise RuntimeError(f"block index: key {i} of an insert is already indexed")
            self._rows[key] = row

    def update(self, keys: np.ndarray, rows: np.ndarray) -> None:
        for key, row in zip(self._split(keys), rows.tolist(), strict=True):
            if key not in self._rows:
                raise RuntimeError("block index: a key to update is not indexed")
            self._rows[key] = row

    def remove(self, keys: np.ndarray) -> None:
        for key in self._split(keys):
            if self._rows.pop(key, None) is None:
                raise RuntimeError("block index: a key to remove is not indexed")

    def lookup_unique(self, keys: np.ndarray) -> tuple[np.ndarray, int] | None:
        split = self._split(keys)
        if len(set(split)) != len(split):
            return None
        rows = np.array([self._rows.get(k, _NONE) for k in split], np.int64)
        return rows, int(np.count_nonzero(rows >= 0))


    def prefix(self, keys: np.ndarray, committed: np.ndarray) -> np.ndarray | None:
        rows = self.lookup(keys)
        stored = rows >= 0
        stored[stored] = committed[rows[stored]]
        rows = rows[: len(rows) if stored.all() else int(np.argmin(stored))]
        return rows if len(np.unique(rows)) == len(rows) else None


def make_index(capacity: int) -> BlockIndex:
    """The C index, or, where it cannot be built, the dict one (logged: it is slower)."""
    try:
        return NativeBlockIndex(capacity)
    except (NativeUnavailable, OSError, ImportError) as e:
        log.warning("block index: the C index is unavailable, using a dict (slower per block)", error=str(e))
        return DictBlockIndex(capacity)
