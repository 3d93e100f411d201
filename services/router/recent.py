"""This router's short memory of which hash chains it just sent to which prefill worker.

Workers publish their cache contents on each heartbeat, so for up to a beat the index in Redis
does not yet show a prompt that was just routed; a related request right behind it would then
miss. Entries expire after a few heartbeats, when Redis is the authority again (workers evict).
"""

from __future__ import annotations

import time
from collections import OrderedDict


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
