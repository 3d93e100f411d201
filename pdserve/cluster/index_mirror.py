"""The router's in-memory mirror of the prefix index, fed by the index's change events.

Redis holds the index (each prefill worker's set of cached hashes, each store node's hash -> tier
map, the cluster tier's set) and a stream of change events that its writers append in the same
transaction as each change (pdserve.cluster.index_events). The mirror snapshots the keys, then tails the stream from the
event before the snapshot: re-applying a change the snapshot already shows is harmless (each
event adds or removes members), so the mirror ends exact. A reset event, or a gap in an owner's
numbering, makes it re-read that owner's key; every `resync_s` it re-reads everything, which
also drops an index whose owner vanished without a word (its key lapsed).

With the mirror a routing decision needs no round trip: a look-up of an 8,192-token prompt
against 8 workers is tens of microseconds of Python instead of a Redis call that queues behind
every other client of the server. Until the first snapshot the router asks Redis as before.

Redis is advisory: when it stops answering (down, stalled, restarted) the mirror keeps answering
from its last copy for `stale_s` (the workers' caches outlive Redis; a stale hint costs a miss,
a Redis call on the request path would cost its timeout) and re-snapshots as soon as Redis
answers. After a restart that lost everything the snapshot is empty and the index is rebuilt by
its writers' reset events (each worker and the store rewrite their whole key when Redis returns).
Any other failure is logged and treated the same way, retried after a bounded backoff: the tail
never ends while the router runs (a mirror whose task ended would answer from a frozen copy).
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from pdserve import logs
from pdserve.cluster import REDIS_DOWN
from pdserve.cluster.index_events import CLUSTER_OWNER, STORE_OWNER, WORKER_OWNER, IndexEvent
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.prefix_index import PrefixHits
from pdserve.runtime.tasks import Backoff, bounded_close, cancel_and_wait

log = logs.get("router.mirror")


def leading_runs(chain: list[bytes], workers: dict[str, set[bytes] | frozenset[bytes]],
                 stores: dict[str, set[bytes] | frozenset[bytes]], worker_nodes: dict[str, str] | None = None,
                 cluster: set[bytes] | frozenset[bytes] = frozenset()) -> PrefixHits:
    """What the router's Lua look-up computes, over in-memory sets: each worker's leading run of
    the chain (a worker's cache is prefix-closed, so a binary search), each store node's leading
    run, the run of a worker's node's store right after the worker's own, and the cluster's run
    right after what the worker can load from its node. `worker_nodes`: each worker's node
    (default "local")."""
    nodes_of = {w: (worker_nodes or {}).get(w, "local") for w in workers}
    n = len(chain)
    if n == 0:
        return PrefixHits({w: 0 for w in workers}, 0, worker_nodes=nodes_of)  # as PrefixIndex.lookup answers it

    def leading(held: set[bytes] | frozenset[bytes]) -> int:
        if chain[0] not in held:
            return 0
        lo, hi = 1, n  # chain[:lo] held; nothing held from hi on
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def scan(held: set[bytes] | frozenset[bytes], start: int) -> int:
        i = start
        while i < n and chain[i] in held:
            i += 1
        return i - start

    empty: frozenset[bytes] = frozenset()
    runs = {w: leading(held) for w, held in workers.items()}
    leads = {node: scan(stores.get(node, empty), 0) for node in sorted(set(nodes_of.values())) or ["local"]}
    after: dict[tuple[str, int], int] = {}
    beyond: dict[int, int] = {}
    store_after, cluster_after = {}, {}
    for w, run in runs.items():
        node = nodes_of[w]
        lead = leads[node]
        if run < lead:
            store_after[w] = lead - run
        elif run == lead:
            store_after[w] = 0
        else:
            if (node, run) not in after:
                after[node, run] = scan(stores.get(node, empty), run)
            store_after[w] = after[node, run]
        loaded = max(lead, run + store_after[w])
        if loaded not in beyond:
            beyond[loaded] = scan(cluster, loaded)
        cluster_after[w] = beyond[loaded]
    return PrefixHits(runs, max(leads.values()), store_after, leads, nodes_of, cluster_after)


class IndexMirror:
    """Owns the router's copy of the index: one set of hashes per prefill worker, one per store
    node, one for the cluster tier."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, block_ms: int = 250, resync_s: float = 60.0,
                 stale_s: float = 30.0):
        self.redis = redis  # its own client: a blocking stream read holds a connection
        self.keys = keys
        self.block_ms = block_ms
        self.resync_s = resync_s
        self.stale_s = stale_s
        self.tailing = False  # snapshot taken and the stream followed since
        self._lost_at: float | None = None  # when tailing stopped after a snapshot (None: never synced)
        self.reloads = 0  # owners re-read after a reset or a gap (tests read it)
        self._workers: dict[str, set[bytes]] = {}
        self._stores: dict[str, set[bytes]] = {}  # store node -> its hashes
        self._cluster: set[bytes] = set()
        self._seq: dict[str, int] = {}
        self._last_id: bytes = b"0-0"
        self._synced_at = 0.0
        self._task: asyncio.Task | None = None
        self._warned = False
        self._backoff = Backoff()

    @property
    def live(self) -> bool:
        """Whether look-ups may be answered here: tailing, or Redis stopped answering less than
        `stale_s` ago (the last copy)."""
        if self.tailing:
            return True
        return self._lost_at is not None and time.monotonic() - self._lost_at < self.stale_s

    def lookup(self, chain: list[bytes], worker_ids: list[str],
               worker_nodes: dict[str, str] | None = None) -> PrefixHits:
        empty: frozenset[bytes] = frozenset()
        return leading_runs(chain, {w: self._workers.get(w, empty) for w in worker_ids}, self._stores,
                            worker_nodes, self._cluster)

    def worker_hashes(self, worker_id: str) -> frozenset[bytes]:
        return frozenset(self._workers.get(worker_id, ()))

    def store_hashes(self, node: str = "local") -> frozenset[bytes]:
        return frozenset(self._stores.get(node, ()))

    def cluster_hashes(self) -> frozenset[bytes]:
        return frozenset(self._cluster)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        await bounded_close(self.redis)

    async def sync(self) -> None:
        """Snapshot every index key; the stream is then read from the event before the snapshot."""
        last = await self.redis.xrevrange(self.keys.index_events(), count=1)
        last_id = last[0][0] if last else b"0-0"
        pattern = self.keys.worker_index("*")
        owners = [WORKER_OWNER + key.decode()[len(pattern) - 1:] async for key in self.redis.scan_iter(match=pattern)]
        workers = {}
        for owner in owners:
            held = await self._read(owner)
            if held:
                workers[owner[len(WORKER_OWNER):]] = held
        pattern = self.keys.store_index("*")
        nodes = [key.decode()[len(pattern) - 1:] async for key in self.redis.scan_iter(match=pattern)]
        self._stores = {node: await self._read(STORE_OWNER + node) for node in nodes}
        self._cluster = await self._read(CLUSTER_OWNER)
        self._workers = workers
        self._seq = {}
        self._last_id = last_id
        self._synced_at = time.monotonic()

    async def poll(self, block_ms: int | None = None) -> int:
        """Apply the events that arrive within block_ms (0: only those already there); returns how many."""
        block = self.block_ms if block_ms is None else block_ms
        reply = await self.redis.xread({self.keys.index_events(): self._last_id}, count=1000, block=block or None)
        applied = 0
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                await self._apply(IndexEvent.parse(fields))
                self._last_id = entry_id
                applied += 1
        return applied

    async def _apply(self, event: IndexEvent) -> None:
        previous = self._seq.get(event.owner)
        self._seq[event.owner] = event.seq
        if event.reset or (previous is not None and event.seq != previous + 1):
            self.reloads += 1
            self._put(event.owner, await self._read(event.owner))
            return
        held = self._held(event.owner)
        held.difference_update(event.removed)
        held.update(event.added)

    def _held(self, owner: str) -> set[bytes]:
        if owner.startswith(STORE_OWNER):
            return self._stores.setdefault(owner[len(STORE_OWNER):], set())
        if owner.startswith(CLUSTER_OWNER):
            return self._cluster
        return self._workers.setdefault(owner[len(WORKER_OWNER):], set())

    async def _read(self, owner: str) -> set[bytes]:
        """The key behind an owner's events (every node's cluster events name the one cluster key)."""
        if owner.startswith(STORE_OWNER):
            members = await self.redis.hkeys(self.keys.store_index(owner[len(STORE_OWNER):]))
        elif owner.startswith(CLUSTER_OWNER):
            members = await self.redis.zrange(self.keys.cluster_index(), 0, -1)
        else:
            members = await self.redis.smembers(self.keys.worker_index(owner[len(WORKER_OWNER):]))
        return {bytes.fromhex(m.decode()) for m in members}

    def _put(self, owner: str, held: set[bytes]) -> None:
        if owner.startswith(STORE_OWNER):
            self._stores[owner[len(STORE_OWNER):]] = held
        elif owner.startswith(CLUSTER_OWNER):
            self._cluster = held
        elif held:
            self._workers[owner[len(WORKER_OWNER):]] = held
        else:
            self._workers.pop(owner[len(WORKER_OWNER):], None)

    async def _run(self) -> None:
        while True:
            try:
                if not self.tailing or time.monotonic() - self._synced_at > self.resync_s:
                    await self.sync()
                    if not self.tailing:
                        log.info("prefix index mirrored", workers=len(self._workers), store_nodes=len(self._stores),
                                 cluster_blocks=len(self._cluster))
                    self.tailing, self._warned = True, False
                await self.poll()
                self._backoff.succeeded()
            except (*REDIS_DOWN, ValueError) as e:
                self._stopped(e)
                await asyncio.sleep(0.25)
            except Exception as e:  # noqa: BLE001 - see the module's docstring
                log.exception("prefix index mirror failed")
                self._stopped(e)
                await asyncio.sleep(self._backoff.failed())

    def _stopped(self, e: Exception) -> None:
        """Tailing stopped: answer from the last copy for `stale_s`, and snapshot again."""
        if self.tailing or not self._warned:
            log.warning("prefix index mirror stopped: answering from its last copy until it resyncs", error=str(e))
            self._warned = True
        if self.tailing:
            self._lost_at = time.monotonic()
        self.tailing = False
