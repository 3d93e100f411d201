"""Store memory: one registered buffer per tier, cut into block-sized slots.

Slots are handed out in runs of adjacent slots whenever possible, so a run of blocks moves as
one transfer-engine slice (docs/architecture.md: coalescing is what makes transfers fast).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch


class RunAllocator:
    """Free slots as sorted, merged runs [start, start + length). Owned by its `TierMemory`."""

    def __init__(self, num_slots: int):
        self._starts: list[int] = [0] if num_slots else []
        self._lengths: dict[int, int] = {0: num_slots} if num_slots else {}
        self.num_free = num_slots

    def allocate(self, n: int) -> np.ndarray:
        """n slots (ascending), as one run when one exists (first fit), else the fewest largest runs."""
        if n > self.num_free:
            raise RuntimeError(f"allocator: want {n} slots, {self.num_free} free")
        fit = next((s for s in self._starts if self._lengths[s] >= n), None)
        runs = [fit] if fit is not None else sorted(self._starts, key=lambda s: -self._lengths[s])
        parts, left = [], n
        for start in runs:
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
        """Free one slot, merged with the free runs beside it."""
        i = bisect.bisect_left(self._starts, slot)
        if (i < len(self._starts) and self._starts[i] == slot) or (
                i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] > slot):
            raise RuntimeError(f"allocator: double free of slot {slot}")
        length = 1
        if i < len(self._starts) and self._starts[i] == slot + 1:  # merge with the run after
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == slot:  # and before
            self._lengths[self._starts[i - 1]] += length
        else:
            self._starts.insert(i, slot)
            self._lengths[slot] = length
        self.num_free += 1


@dataclass(frozen=True)
class TierInfo:
    name: str  # "device" | "dram"
    kind: str  # "host" (the store's tiers live in host memory: docs/architecture.md, GPUs)
    num_slots: int
    block_nbytes: int


class TierMemory:
    """One tier's buffer [num_slots * block_nbytes] bytes and its slot allocator."""

    def __init__(self, name: str, num_slots: int, block_nbytes: int):
        self.info = TierInfo(name, "host", num_slots, block_nbytes)
        self.block_nbytes = block_nbytes
        # uint8 so any KV dtype fits; one allocation keeps adjacent slots adjacent in memory.
        self.buffer = torch.zeros(max(num_slots, 1) * block_nbytes, dtype=torch.uint8)
        self.allocator = RunAllocator(num_slots)
        self.base_address = self.buffer.data_ptr()  # the buffer never moves

    @property
    def nbytes(self) -> int:
        return self.info.num_slots * self.block_nbytes

    def address(self, slot: int) -> int:
        return self.base_address + slot * self.block_nbytes

    def view(self, slot: int) -> torch.Tensor:
        return self.buffer[slot * self.block_nbytes : (slot + 1) * self.block_nbytes]
