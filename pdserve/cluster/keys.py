"""Every Redis key pdserve uses, in one place. All live under one prefix; all are bounded: each
has a TTL its owner refreshes (so a deployment that vanishes leaves nothing behind for long) and,
where it could grow while its owner lives, a cap."""

from __future__ import annotations

import time
from dataclasses import dataclass

WINDOW_S = 60  # hit-rate counters are kept per minute ...
KEEP_WINDOWS = 60  # ... for an hour
INDEX_TTL_S = 600  # an index whose owner stops refreshing it disappears
INDEX_EVENTS_MAXLEN = 20_000  # change events kept for routers' mirrors (minutes of history)
HEARTBEAT_TTLS = 3  # a worker's registration lives this many heartbeat intervals past its last beat
WORKERS_TTL_S = 600  # the workers ZSET itself, refreshed by every beat
CLUSTER_INDEX_MAX = 1_000_000  # hints of what the cluster tier holds (16 MB of Redis at most)


def window_start(now: float | None = None) -> int:
    now = time.time() if now is None else now
    return int(now // WINDOW_S) * WINDOW_S


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "pdserve"

    @classmethod
    def for_url(cls, url: str, prefix: str) -> RedisKeys:
        """On a Redis Cluster the prefix becomes a hash tag ("{pdserve}:..."): every key of one
        deployment lands in one slot, which its scripts (the look-up reads every index at once)
        and transactions (an index change and its event) need. One shard then carries one
        deployment, which is far from a limit: routers read a mirror, not Redis, per request;
        each worker writes once a second and each store node twenty times, so a deployment of a
        hundred workers sends Redis a few hundred small writes a second (one shard serves ~100k),
        and its keys are capped (CLUSTER_INDEX_MAX, pages per worker). Deployments under other
        prefixes spread over the shards; the cluster buys them failover and room."""
        from pdserve.cluster import is_cluster

        return cls("{" + prefix + "}" if is_cluster(url) else prefix)

    def store_index(self, node: str = "local") -> str:
        """HASH block-hash hex -> tier ("device" | "dram"); one store node's local contents
        (capped by its slots; TTL INDEX_TTL_S, refreshed by each flush)."""
        return f"{self.prefix}:index:store:{node}"

    def cluster_index(self) -> str:
        """ZSET block-hash hex -> when a node last wrote or fetched it: what the cluster tier holds,
        as its store nodes saw it (added when a node's write or read succeeded, removed when a
        read missed). The cluster evicts on its own, so each write trims it, oldest first, to what
        the nodes' segments hold (`cluster_capacity`), at most CLUSTER_INDEX_MAX; TTL INDEX_TTL_S
        refreshed by each writer."""
        return f"{self.prefix}:index:cluster"

    def cluster_capacity(self) -> str:
        """HASH node -> "blocks:unix time": what its segment of the cluster holds (0: it only uses
        the cluster), as of its last flush; an entry older than INDEX_TTL_S (a node gone, or
        renamed) is removed by the next write. TTL INDEX_TTL_S, refreshed by each node's flush."""
        return f"{self.prefix}:index:cluster-capacity"

    def worker_index(self, worker: str) -> str:
        """SET of block-hash hex held in a worker's own prefix cache (capped by its pages; expires
        with its registration)."""
        return f"{self.prefix}:index:worker:{worker}"

    def index_events(self) -> str:
        """STREAM of prefix-index changes (capped at INDEX_EVENTS_MAXLEN, TTL INDEX_TTL_S refreshed
        by each writer), written in the same transaction as the index keys they change; routers
        tail it to keep a local mirror."""
        return f"{self.prefix}:index:events"

    def hits(self, scope: str, window: int) -> str:
        """HASH of counters (hit_blocks, miss_blocks, hit_tokens, lookup_tokens) for one window
        (TTL WINDOW_S * KEEP_WINDOWS)."""
        return f"{self.prefix}:hits:{scope}:{window}"

    def worker(self, worker: str) -> str:
        """HASH: a worker's registration and load; expires HEARTBEAT_TTLS intervals after its last
        beat. A worker that leaves on purpose overwrites it with a tombstone ({"left": time})
        that expires likewise, so routers can tell leaving from Redis having lost the record."""
        return f"{self.prefix}:worker:{worker}"

    def workers(self) -> str:
        """ZSET worker id -> last heartbeat time; each router's registry read removes the ids
        whose HASH is gone (lapsed workers), and the set expires WORKERS_TTL_S after the last beat."""
        return f"{self.prefix}:workers"
