"""Store memory: one registered buffer per tier, cut into block-sized slots.

Slots are handed out in runs of adjacent slots whenever possible, so a run of blocks moves as
one transfer-engine slice (DESIGN.md: ~45 µs per slice here; coalescing is what makes it fast).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch


class RunAllocator:
    """Free slots as sorted, merged runs [start, start + length). Owned by its `TierMemory`."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._starts: list[int] = [0] if num_slots else []
        self._lengths: dict[int, int] = {0: num_slots} if num_slots else {}
        self.num_free = num_slots

    def allocate(self, n: int) -> np.ndarray:
        """n slots (int64, ascending), as one run when one exists (first fit), else the fewest
        largest runs."""
        if n > self.num_free:
            raise RuntimeError(f"allocator: want {n} slots, {self.num_free} free")
        for start in self._starts:
            if self._lengths[start] >= n:
                self._take(start, n)
                return np.arange(start, start + n, dtype=np.int64)
        parts, left = [], n
        for start in sorted(self._starts, key=lambda s: -self._lengths[s]):
            take = min(self._lengths[start], left)
            self._take(start, take)
            parts.append(np.arange(start, start + take, dtype=np.int64))
            left -= take
            if not left:
                break
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, np.int64)

    def _take(self, start: int, n: int) -> None:
        length = self._lengths.pop(start)
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        if length > n:
            self._starts.insert(i, start + n)
            self._lengths[start + n] = length - n
        self.num_free -= n

    def free(self, slot: int) -> None:
        self.free_run(slot, 1)

    def free_many(self, slots: list[int]) -> None:
        """Free every slot of `slots` (any order), a run of adjacent ones at a time."""
        slots = sorted(slots)
        i = 0
        while i < len(slots):
            n = 1
            while i + n < len(slots) and slots[i + n] == slots[i] + n:
                n += 1
            self.free_run(slots[i], n)
            i += n

    def free_run(self, start: int, n: int) -> None:
        """Free slots [start, start + n), merged with the free runs beside them."""
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + n) or (
                i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] > start):
            raise RuntimeError(f"allocator: double free in slots [{start}, {start + n})")
        length = n
        if i < len(self._starts) and self._starts[i] == start + n:  # merge with the run after
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:  # and before
            self._lengths[self._starts[i - 1]] += length
        else:
            self._starts.insert(i, start)
            self._lengths[start] = length
        self.num_free += n

    def runs(self) -> list[tuple[int, int]]:
        return [(s, self._lengths[s]) for s in self._starts]


@dataclass(frozen=True)
class TierInfo:
    name: str  # "device" | "dram"
    kind: str  # "cuda" | "host"
    num_slots: int
    block_nbytes: int


class TierMemory:
    """One tier's buffer [num_slots * block_nbytes] bytes and its slot allocator."""

    def __init__(self, name: str, num_slots: int, block_nbytes: int, device: str = "cpu"):
        self.info = TierInfo(name, "cuda" if device.startswith("cuda") else "host", num_slots, block_nbytes)
        self.block_nbytes = block_nbytes
        # uint8 so any KV dtype fits; one allocation keeps adjacent slots adjacent in memory.
        self.buffer = torch.zeros(max(num_slots, 1) * block_nbytes, dtype=torch.uint8, device=device)
        self.allocator = RunAllocator(num_slots)
        self.base_address = self.buffer.data_ptr()  # the buffer never moves

    @property
    def nbytes(self) -> int:
        return self.info.num_slots * self.block_nbytes

    def address(self, slot: int) -> int:
        return self.base_address + slot * self.block_nbytes

    def view(self, slot: int) -> torch.Tensor:
        return self.buffer[slot * self.block_nbytes : (slot + 1) * self.block_nbytes]


def copy_slot(src: TierMemory, src_slot: int, dst: TierMemory, dst_slot: int) -> None:
    dst.view(dst_slot).copy_(src.view(src_slot))


# (tier, slot) the bytes go to -> (tier, slot) they come from.
SlotMoves = dict[tuple[str, int], tuple[str, int]]


def copy_slots(tiers: dict[str, TierMemory], moves: SlotMoves) -> None:
    """Every move of `moves`, runs of adjacent slots (adjacent at both ends) as one copy. No slot
    may be both a source and a destination."""
    pairs = sorted((src_tier, src, dst_tier, dst) for (dst_tier, dst), (src_tier, src) in moves.items())
    i = 0
    while i < len(pairs):
        src_tier, src, dst_tier, dst = pairs[i]
        n = 1
        while i + n < len(pairs) and pairs[i + n] == (src_tier, src + n, dst_tier, dst + n):
            n += 1
        a, b, size = tiers[src_tier], tiers[dst_tier], tiers[src_tier].block_nbytes
        b.buffer[dst * size:(dst + n) * size].copy_(a.buffer[src * size:(src + n) * size])
        i += n
