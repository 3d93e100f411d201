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
        chains = self._by_worker.get(worker_id)
        if not chains:
            return 0
        oldest = self.clock() - self.ttl_s
        n = 0
        for h in hashes:
            t = chains.get(h)
            if t is None or t < oldest:
                break
            n += 1
        return n
