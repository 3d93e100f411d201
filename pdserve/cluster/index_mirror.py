"""The router's in-memory mirror of the prefix index, fed by the index's change events.

Redis holds the index (each prefill worker's set of cached hashes, the store's hash -> tier map)
and a stream of change events that its writers append in the same transaction as each change
(pdserve.cluster.index_events). The mirror snapshots the keys, then tails the stream from the
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
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from pdserve import logs
from pdserve.cluster.index_events import STORE_OWNER, WORKER_OWNER, IndexEvent
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.prefix_index import PrefixHits
from pdserve.runtime.tasks import bounded_close, cancel_and_wait

log = logs.get("router.mirror")


def leading_runs(chain: list[bytes], workers: dict[str, set[bytes] | frozenset[bytes]],
                 store: set[bytes]) -> PrefixHits:
    """What the router's Lua look-up computes, over in-memory sets: each worker's leading run of
    the chain (a worker's cache is prefix-closed, so a binary search), the store's leading run,
    and the store's run right after each worker's own."""
    n = len(chain)
    if n == 0:
        return PrefixHits({w: 0 for w in workers}, 0)  # as PrefixIndex.lookup answers it

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

    def scan(start: int) -> int:
        i = start
        while i < n and chain[i] in store:
            i += 1
        return i - start

    runs = {w: leading(held) for w, held in workers.items()}
    lead = scan(0)
    after: dict[int, int] = {}
    store_after = {}
    for w, run in runs.items():
        if run < lead:
            store_after[w] = lead - run
        elif run == lead:
            store_after[w] = 0
        else:
            store_after[w] = after.setdefault(run, scan(run))
    return PrefixHits(runs, lead, store_after)


class IndexMirror:
    """Owns the router's copy of the index: one set of hashes per prefill worker, one for the store."""

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
        self._store: set[bytes] = set()
        self._seq: dict[str, int] = {}
        self._last_id: bytes = b"0-0"
        self._synced_at = 0.0
        self._task: asyncio.Task | None = None
        self._warned = False

    @property
    def live(self) -> bool:
        """Whether look-ups may be answered here: tailing, or Redis stopped answering less than
        `stale_s` ago (the last copy)."""
        if self.tailing:
            return True
        return self._lost_at is not None and time.monotonic() - self._lost_at < self.stale_s

    def lookup(self, chain: list[bytes], worker_ids: list[str]) -> PrefixHits:
        empty: frozenset[bytes] = frozenset()
        return leading_runs(chain, {w: self._workers.get(w, empty) for w in worker_ids}, self._store)

    def worker_hashes(self, worker_id: str) -> frozenset[bytes]:
        return frozenset(self._workers.get(worker_id, ()))

    def store_hashes(self) -> frozenset[bytes]:
        return frozenset(self._store)

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
        self._store = await self._read(STORE_OWNER)
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
        held = self._store if event.owner == STORE_OWNER else self._workers.setdefault(
            event.owner[len(WORKER_OWNER):], set())
        held.difference_update(event.removed)
        held.update(event.added)

    async def _read(self, owner: str) -> set[bytes]:
        if owner == STORE_OWNER:
            members = await self.redis.hkeys(self.keys.store_index())
        else:
            members = await self.redis.smembers(self.keys.worker_index(owner[len(WORKER_OWNER):]))
        return {bytes.fromhex(m.decode()) for m in members}

    def _put(self, owner: str, held: set[bytes]) -> None:
        if owner == STORE_OWNER:
            self._store = held
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
                        log.info("prefix index mirrored", workers=len(self._workers), store_blocks=len(self._store))
                    self.tailing, self._warned = True, False
                await self.poll()
            except (aioredis.RedisError, OSError, ValueError) as e:
                if self.tailing or not self._warned:
                    log.warning("prefix index mirror stopped: answering from its last copy until it resyncs",
                                error=str(e))
                    self._warned = True
                if self.tailing:
                    self._lost_at = time.monotonic()
                self.tailing = False
                await asyncio.sleep(0.25)
