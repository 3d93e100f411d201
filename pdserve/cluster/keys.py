"""Every Redis key pdserve uses, in one place. All live under one prefix; all are bounded."""

from __future__ import annotations

import time
from dataclasses import dataclass

WINDOW_S = 60  # hit-rate counters are kept per minute ...
KEEP_WINDOWS = 60  # ... for an hour
INDEX_TTL_S = 600  # an index whose owner stops refreshing it disappears
INDEX_EVENTS_MAXLEN = 20_000  # change events kept for routers' mirrors (minutes of history)


def window_start(now: float | None = None) -> int:
    now = time.time() if now is None else now
    return int(now // WINDOW_S) * WINDOW_S


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "pdserve"

    def store_index(self) -> str:
        """HASH block-hash hex -> tier ("device" | "dram"); the store's contents."""
        return f"{self.prefix}:index:store"

    def worker_index(self, worker: str) -> str:
        """SET of block-hash hex held in a worker's own prefix cache (capped by its pages)."""
        return f"{self.prefix}:index:worker:{worker}"

    def index_events(self) -> str:
        """STREAM of prefix-index changes (capped at INDEX_EVENTS_MAXLEN), written in the same
        transaction as the index keys they change; routers tail it to keep a local mirror."""
        return f"{self.prefix}:index:events"

    def hits(self, scope: str, window: int) -> str:
        """HASH of counters (hit_blocks, miss_blocks, hit_tokens, lookup_tokens) for one window."""
        return f"{self.prefix}:hits:{scope}:{window}"

    def worker(self, worker: str) -> str:
        """HASH: a worker's registration and load; expires unless its heartbeat refreshes it."""
        return f"{self.prefix}:worker:{worker}"

    def workers(self) -> str:
        """ZSET worker id -> last heartbeat time (pruned of lapsed workers by readers)."""
        return f"{self.prefix}:workers"
