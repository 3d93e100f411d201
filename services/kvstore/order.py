"""One tier's eviction order, over block ids (see table.py)."""

from __future__ import annotations

from collections import deque

import numpy as np

# Dead items an order may hold beyond as many as its live ones, before it sheds them all.
SHED_AFTER = 1024

_Chunk = tuple[np.ndarray, np.ndarray]  # (ids, the stamp each had when queued)


class EvictionOrder:
    """One tier's committed, unpinned, non-tail blocks in the order they would be evicted: first
    the copies their writers keep in their own caches (oldest first), then the rest, least
    recently used first.

    Two append-only queues of chunks with lazy deletion: adding or touching blocks appends them
    as one chunk with fresh stamps (the table's stamp column, set by BlockTable.queue),
    discarding clears the stamp, and a queued item counts while its row still bears its stamp. So a call's thousand
    blocks are one chunk, and dead items are shed as the head is popped, or all at once when
    they outnumber the live. Owns the queues; the stamps are the table's column."""

    def __init__(self, table) -> None:  # table: BlockTable (its stamp and duplicate columns)
        self._table = table
        self._queues: tuple[deque[_Chunk], deque[_Chunk]] = (deque(), deque())  # copies, the rest
        self._queued = 0
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def add(self, block_ids: np.ndarray) -> None:
        """Queue blocks (all of this order's tier) at the recent end of their queue; one already
        queued keeps its place. `block_ids` must not repeat."""
        groups, stamp = self._table.queue(block_ids)  # (the other tier's two groups are empty)
        for q, part in zip((0, 1, 0, 1), groups, strict=True):
            if len(part):
                self.append(q, part.copy(), stamp)
                stamp += len(part)

    def touch(self, block_ids: np.ndarray) -> None:
        """Most recently used now, those queued (a copy keeps its place among the copies)."""
        stamp = self._table.stamp
        moved = block_ids[(stamp[block_ids] != 0) & ~self._table.duplicate[block_ids]]
        if len(moved):
            self._live -= len(moved)
            stamp[moved] = 0
            self.add(moved)

    def append(self, q: int, block_ids: np.ndarray, first_stamp: int) -> None:
        """Blocks the table has just stamped (BlockTable.queue), from first_stamp on, at the
        recent end of queue q (0: the copies, 1: the rest)."""
        if not len(block_ids):
            return
        self._queues[q].append((block_ids, np.arange(first_stamp, first_stamp + len(block_ids), dtype=np.int64)))
        self._queued += len(block_ids)
        self._live += len(block_ids)
        if self._queued > 2 * self._live + SHED_AFTER:  # mostly dead: keep the live only
            self._compact()

    def left(self, n: int) -> None:
        """n of its blocks left it, their stamps cleared by the table (BlockTable.pin)."""
        self._live -= n

    def discard(self, block_ids: np.ndarray) -> None:
        stamp = self._table.stamp
        queued = block_ids[stamp[block_ids] != 0]
        stamp[queued] = 0
        self._live -= len(queued)

    def pop(self, n: int) -> np.ndarray:
        """The first n blocks to evict, in order, out of the order."""
        if n > self._live:
            raise KeyError(f"eviction order: {n} wanted, {self._live} queued")
        taken = self._take(n)
        self._table.stamp[taken] = 0
        self._live -= n
        return taken

    def peek(self, n: int) -> tuple[list[int], list[int]]:
        """The first n (at most) live copies and the first n live others, in order, left queued."""
        copies, rest = (self._live_ids(q, n) for q in self._queues)
        return copies, rest

    def ids(self) -> list[int]:
        """Every queued block, first to evict first."""
        return [i for q in self._queues for i in self._live_ids(q, self._live)]

    def _live_ids(self, queue: deque[_Chunk], n: int) -> list[int]:
        out: list[int] = []
        stamp = self._table.stamp
        for ids, stamps in queue:
            if len(out) >= n:
                break
            out += ids[stamp[ids] == stamps][: n - len(out)].tolist()
        return out

    def _take(self, n: int) -> np.ndarray:
        parts: list[np.ndarray] = []
        need = n
        stamp = self._table.stamp
        for queue in self._queues:
            while need and queue:
                ids, stamps = queue[0]
                at = np.flatnonzero(stamp[ids] == stamps)
                if len(at) <= need:
                    queue.popleft()
                    self._queued -= len(ids)
                    parts.append(ids[at])
                    need -= len(at)
                else:
                    cut = int(at[need - 1]) + 1
                    parts.append(ids[at[:need]])
                    queue[0] = (ids[cut:], stamps[cut:])
                    self._queued -= cut
                    need = 0
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _compact(self) -> None:
        stamp = self._table.stamp
        self._queued = 0
        for queue in self._queues:
            if not queue:
                continue
            ids = np.concatenate([c[0] for c in queue])
            stamps = np.concatenate([c[1] for c in queue])
            live = stamp[ids] == stamps
            queue.clear()
            if live.any():
                queue.append((ids[live], stamps[live]))
                self._queued += int(live.sum())
