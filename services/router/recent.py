"""This router's short memories: which hash chains it just sent to which prefill worker, and
the recent median of a measured figure (what TTFT estimates missed by, how long a decode worker
took to admit), expired so that it cannot latch.

Workers publish their cache contents on each heartbeat, so for up to a beat the index in Redis
does not yet show a prompt that was just routed; a related request right behind it would then
miss. Entries expire after a few heartbeats, when Redis is the authority again (workers evict).
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Collection


class RecentRoutes:
    """Owns, per worker, hash -> time routed; bounded in size and age."""

    def __init__(self, ttl_s: float = 3.0, max_per_worker: int = 65536, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_per_worker = max_per_worker
        self.clock = clock
        self._by_worker: dict[str, OrderedDict[bytes, float]] = {}

    def add(self, worker_id: str, hashes: list[bytes]) -> None:
        chains = self._by_worker.setdefault(worker_id, OrderedDict())
        now = self.clock()
        for h in hashes:
            chains[h] = now
            chains.move_to_end(h)
        while len(chains) > self.max_per_worker:
            chains.popitem(last=False)

    def keep_only(self, worker_ids: Collection[str]) -> None:
        """Forget every worker but these (the pool's, when it forgets one: a worker id holds its
        port, so with workers coming and going the ids never recur)."""
        for worker_id in self._by_worker.keys() - set(worker_ids):
            del self._by_worker[worker_id]

    def leading(self, worker_id: str, hashes: list[bytes]) -> int:
        """How many leading hashes of the chain were routed to this worker within the TTL.

        Every chain that holds a block also holds all blocks before it, so each add() that
        stamps a block stamps its predecessors too: freshness never increases along a chain,
        and a binary search (log2 n look-ups, not n) finds where it ends."""
        chains = self._by_worker.get(worker_id)
        if not chains:
            return 0
        oldest = self.clock() - self.ttl_s

        def fresh(i: int) -> bool:
            t = chains.get(hashes[i])
            return t is not None and t >= oldest

        lo, hi = 0, len(hashes)  # the first lo are fresh; none from hi on
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fresh(mid - 1):
                lo = mid
            else:
                hi = mid - 1
        return lo


class RecentMedian:
    """The median of the values added in the last `horizon_s` (the newest `maxlen` at most), once
    there are `min_count` of them; else 0. Only what a router admitted is ever measured, so a
    figure kept past its moment would latch: one over the SLO refuses every request, and no
    measurement comes to lower it (docs/perf-log.md, S42). Owns its samples and their median."""

    def __init__(self, horizon_s: float, min_count: int = 1, maxlen: int | None = None, clock=time.monotonic):
        self.horizon_s = horizon_s
        self.min_count = min_count
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)  # (when, value)
        self._median: float | None = 0.0  # None: to be computed again

    def add(self, value: float) -> None:
        self._samples.append((self.clock(), value))
        self._median = None

    def value(self) -> float:
        horizon = self.clock() - self.horizon_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
            self._median = None
        if self._median is None:
            enough = len(self._samples) >= self.min_count
            self._median = statistics.median(v for _, v in self._samples) if enough else 0.0
        return self._median
