"""Mirrors the store's contents and hit counters into Redis, off the request path.

Also the node's changes to the cluster index (what the cluster tier holds, as this node saw it:
its writes that succeeded, its reads that missed), which the tier's threads hand over through a
thread-safe deque.

Redis down: the store keeps serving; changes accumulate (latest state per key), and once Redis
answers again the whole index is rebuilt from the store's contents. So is an index that vanished
while Redis stayed up (flushed, deleted): each flush checks the key still exists when it should.
Any other failure of a flush is logged and the index rebuilt after a bounded backoff: the writer
never ends while the store runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve import logs
from pdserve.cluster import REDIS_DOWN, connect, transaction
from pdserve.cluster.index_events import EventWriter, cluster_owner, store_owner
from pdserve.cluster.keys import (
    CLUSTER_INDEX_MAX,
    INDEX_EVENTS_MAXLEN,
    INDEX_TTL_S,
    KEEP_WINDOWS,
    WINDOW_S,
    RedisKeys,
    window_start,
)
from pdserve.kv.hashing import HASH_BYTES
from pdserve.runtime.tasks import Backoff, cancel_and_wait

log = logs.get("kvstore.index")


# One flush's changes, unpacked in Redis: ARGV holds pairs (tier, or "" for dropped; the keys as
# one hex string, 32 characters each). Sent as HSET/HDEL arguments instead, redis-py encodes
# each one in Python on the store's event loop: 12 ms of its CPU for 8,192 blocks, a stall for
# every control call behind it; this way the loop joins and hex-encodes one string per tier
# (1.7 ms), and Redis spends about 5 ms more than on the plain HSET.
APPLY_CHANGES = """
local index = KEYS[1]
for a = 1, #ARGV, 2 do
  local tier, keys = ARGV[a], ARGV[a + 1]
  local n = #keys / 32
  local i = 0
  while i < n do
    local j = math.min(i + 2000, n)
    local args = {}
    for k = i, j - 1 do
      args[#args + 1] = string.sub(keys, k * 32 + 1, k * 32 + 32)
      if tier ~= "" then args[#args + 1] = tier end
    end
    if tier ~= "" then
      redis.call("HSET", index, unpack(args))
    else
      redis.call("HDEL", index, unpack(args))
    end
    i = j
  end
end
return 0
"""

# The node's changes to the cluster index, and its event, in one script: KEYS the index ZSET, the
# capacity HASH, the event stream; ARGV the time (each member's score), owner, seq, stream maxlen,
# TTL, hard cap, then pairs: held ("1" or "0") and the keys as one hex string. The index is then
# trimmed, oldest first, to what the nodes' segments hold (their capacity entries, "blocks:time",
# summed over the nodes that wrote theirs within the TTL; older entries are removed): the cluster
# evicts on its own, and hints past its size would promise blocks long gone. What the trim
# took goes out in the event's removed list, so mirrors drop it too (hence the event is written
# here, where the trimmed members are known, not queued beside the script).
APPLY_CLUSTER = """
local index, capacity, events = KEYS[1], KEYS[2], KEYS[3]
local now, owner, seq, maxlen, ttl, hard = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local added, removed = {}, {}
local function unhex(hex) return (hex:gsub('..', function(cc) return string.char(tonumber(cc, 16)) end)) end
for a = 7, #ARGV - 1, 2 do
  local held, keys = ARGV[a], ARGV[a + 1]
  for i = 0, #keys / 32 - 1, 1000 do
    local args = {}
    for k = i, math.min(i + 999, #keys / 32 - 1) do
      local m = string.sub(keys, k * 32 + 1, k * 32 + 32)
      if held == "1" then args[#args + 1] = now end
      args[#args + 1] = m
    end
    if held == "1" then redis.call("ZADD", index, unpack(args)) else redis.call("ZREM", index, unpack(args)) end
  end
  if held == "1" then added[#added + 1] = keys else removed[#removed + 1] = keys end
end
local cap = 0
local nodes = redis.call("HGETALL", capacity)
for i = 1, #nodes, 2 do
  local blocks, at = string.match(nodes[i + 1], "^(%d+):([%d.]+)$")
  if blocks and tonumber(now) - tonumber(at) <= tonumber(ttl) then
    cap = cap + tonumber(blocks)
  else
    redis.call("HDEL", capacity, nodes[i])  -- a node gone this long (or renamed): its segment is no more
  end
end
local over = redis.call("ZCARD", index) - math.min(cap, hard)
if over > 0 then
  local gone = redis.call("ZRANGE", index, 0, over - 1)
  redis.call("ZREMRANGEBYRANK", index, 0, over - 1)
  removed[#removed + 1] = table.concat(gone)
end
redis.call("EXPIRE", index, ttl)
redis.call("XADD", events, "MAXLEN", "~", maxlen, "*", "owner", owner, "seq", seq, "reset", 0,
           "added", unhex(table.concat(added)), "removed", unhex(table.concat(removed)))
redis.call("EXPIRE", events, ttl)
return over > 0 and over or 0
"""


@dataclass(frozen=True, slots=True)
class _Committed:
    keys: Sequence[bytes]
    tiers: Sequence[str]


class RedisIndex:
    """Owns the pending index changes and the Redis connection state of one store node."""

    def __init__(self, url: str, keys: RedisKeys, snapshot: Callable[[], list[tuple[bytes, str]]],
                 interval_s: float = 0.05, node: str = "local"):
        self.redis = connect(url, 1.0)
        self.keys = keys
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.connected = False
        self._rebuild = True  # first flush writes the whole index
        self._indexed = False  # the index held something after the last flush (so it must exist)
        # Changes not yet in Redis, in order: (key, tier or None for dropped) or a commit's
        # keys and tiers, paired up at the flush (off the commit's path; later changes to them
        # come later in the log).
        self._log: list[tuple[bytes, str | None] | _Committed] = []
        self._hits = 0
        self._misses = 0
        self._task: asyncio.Task | None = None
        self._warned = False
        self._backoff = Backoff()
        self.node = node
        self._events = EventWriter(keys, store_owner(node))
        self._cluster_log: deque[tuple[bytes, bool]] = deque()  # (hash, held): appended by the tier's threads
        self._cluster_events = EventWriter(keys, cluster_owner(node))
        self.cluster_capacity_blocks: int | None = None  # this node's segment, in blocks (None: no cluster tier)

    # IndexSink: called on the event loop, never blocks.
    def committed(self, keys: Sequence[bytes], tiers: Sequence[str]) -> None:
        self._log.append(_Committed(keys, tiers))

    def moved(self, key: bytes, tier: str) -> None:
        self._log.append((key, tier))

    def dropped(self, key: bytes) -> None:
        self._log.append((key, None))

    def _take_pending(self) -> dict[bytes, str | None]:
        """The latest state of each key changed since the last flush."""
        pending: dict[bytes, str | None] = {}
        for change in self._log:
            if isinstance(change, _Committed):
                pending.update(zip(change.keys, change.tiers, strict=True))
            else:
                pending[change[0]] = change[1]
        self._log = []
        return pending

    # ClusterSink: called from the cluster tier's threads (deque appends are atomic).
    def cluster_stored(self, hashes: Iterable[bytes]) -> None:
        self._cluster_log.extend((h, True) for h in hashes)

    def cluster_missing(self, hashes: Iterable[bytes]) -> None:
        self._cluster_log.extend((h, False) for h in hashes)

    def _take_cluster(self) -> dict[bytes, bool]:
        pending: dict[bytes, bool] = {}
        while self._cluster_log:
            h, held = self._cluster_log.popleft()
            pending[h] = held
        return pending

    def _queue_cluster(self, pipe, pending: dict[bytes, bool]) -> None:
        held = [h for h, v in pending.items() if v and len(h) == HASH_BYTES]
        gone = [h for h, v in pending.items() if not v and len(h) == HASH_BYTES]
        args = [a for flag, ks in (("1", held), ("0", gone)) if ks for a in (flag, b"".join(ks).hex())]
        keys = (self.keys.cluster_index(), self.keys.cluster_capacity(), self.keys.index_events())
        pipe.eval(APPLY_CLUSTER, len(keys), *keys, f"{time.time():.6f}", self._cluster_events.owner,
                  self._cluster_events.take_seq(), INDEX_EVENTS_MAXLEN, INDEX_TTL_S, CLUSTER_INDEX_MAX, *args)

    def looked_up(self, hits: int, misses: int) -> None:
        self._hits += hits
        self._misses += misses

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        try:
            await self.flush()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        await self.redis.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self.flush()
                if not self.connected:
                    log.info("redis connected: prefix index rebuilt", index=self.keys.store_index())
                self.connected = True
                self._warned = False
                self._backoff.succeeded()
            except REDIS_DOWN as e:
                if self.connected or not self._warned:
                    log.warning("redis unavailable: serving on, index will be rebuilt", error=str(e))
                    self._warned = True
                self.connected = False
                self._rebuild = True
            except Exception:  # noqa: BLE001 - a writer that ended would leave the index stale for good
                log.exception("prefix index flush failed: rebuilding it")
                self.connected = False
                self._rebuild = True
                await asyncio.sleep(self._backoff.failed())
            await asyncio.sleep(self.interval_s)

    def _queue_changes(self, pipe, index: str, changes) -> dict[str, list[bytes]]:
        """Queue (key, tier or None for dropped) changes on `pipe` as one script call; returns
        the keys by tier ("" for dropped)."""
        by_tier: dict[str, list[bytes]] = {}
        for key, tier in changes:
            if len(key) == HASH_BYTES:  # (only block hashes are indexed: 32 hex characters each)
                by_tier.setdefault(tier or "", []).append(key)
        if by_tier:
            args = [a for tier, ks in by_tier.items() for a in (tier, b"".join(ks).hex())]
            # EVAL, not EVALSHA: in a transaction a script Redis lost (restart, failover) would fail
            # the whole flush; the body is 1 KB, and Redis caches it compiled.
            pipe.eval(APPLY_CHANGES, 1, index, *args)
        return by_tier

    async def flush(self) -> None:
        index = self.keys.store_index(self.node)
        # A transaction: the index and its change event land together (see index_events).
        pipe = await transaction(self.redis)
        pipe.exists(index)
        if self._rebuild:
            pending, self._log = {}, []
            pipe.delete(index)
            self._queue_changes(pipe, index, self.snapshot())
            self._events.queue(pipe, reset=True)
        else:
            pending = self._take_pending()
            if pending:
                by_tier = self._queue_changes(pipe, index, pending.items())
                self._events.queue(pipe, added=[k for tier, ks in by_tier.items() if tier for k in ks],
                                   removed=by_tier.get("", []))
        pipe.expire(index, INDEX_TTL_S)
        if self.cluster_capacity_blocks is not None:  # (each flush: the trim sums every node's)
            pipe.hset(self.keys.cluster_capacity(), self.node, f"{self.cluster_capacity_blocks}:{time.time():.0f}")
            pipe.expire(self.keys.cluster_capacity(), INDEX_TTL_S)
        cluster = self._take_cluster()
        if cluster:
            self._queue_cluster(pipe, cluster)
        hits, misses = self._hits, self._misses
        if hits or misses:
            window = self.keys.hits("store", window_start())
            pipe.hincrby(window, "hit_blocks", hits)
            pipe.hincrby(window, "miss_blocks", misses)
            pipe.expire(window, WINDOW_S * KEEP_WINDOWS)
        pipe.hlen(index)
        try:
            results = await pipe.execute()
        except BaseException:
            self._log[:0] = pending.items()  # not written: ahead of what came since, which wins
            self._cluster_log.extendleft(reversed(cluster.items()))
            raise
        self._hits -= hits
        self._misses -= misses
        existed, size = results[0], results[-1]
        lost = self._indexed and not existed and not self._rebuild
        if lost:
            log.warning("the store's index vanished from redis: rebuilding it", index=index)
        self._rebuild = lost  # (the changes just written went into a fresh key: the rebuild rewrites it)
        self._indexed = size > 0
