"""A worker's registration against a real Redis: the cache index is published as deltas, and a
set that lapsed or diverged is rewritten whole on the next beat."""

from __future__ import annotations

import asyncio

from pdserve.cluster import connect_sync
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.registry import Registration
from pdserve.kv.layout import HashProfile, KVLayout

PROFILE = HashProfile("f" * 64, KVLayout(4, 2, 16, 64, "float32"))


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_cache_index_published_as_deltas_and_repaired(shared_redis_url, key_prefix):
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    cache = {h(i) for i in range(1000)}
    reg = Registration(shared_redis_url, keys, "p0", "prefill", "127.0.0.1:1", PROFILE,
                       load=lambda: {"queued_tokens": 0}, cached_hashes=lambda: list(cache))
    sync = connect_sync(shared_redis_url, 2.0)
    index = keys.worker_index("p0")

    def published() -> set[bytes]:
        return {bytes.fromhex(m.decode()) for m in sync.smembers(index)}

    async def scenario() -> None:
        await reg.beat()
        assert published() == cache and reg._published == frozenset(cache)
        # Evict 10, add 5: only those travel, and the set matches again.
        for i in range(10):
            cache.discard(h(i))
        cache.update(h(2000 + i) for i in range(5))
        await reg.beat()
        assert published() == cache and sync.scard(index) == 995
        # The set lapses (a stalled worker) and the cache changes: the delta alone leaves a partial
        # set, which the size check catches; the next beat writes it whole.
        sync.delete(index)
        cache.add(h(3000))
        await reg.beat()
        assert published() == {h(3000)} and reg._published is None
        await reg.beat()
        assert published() == cache and sync.ttl(index) > 0
        assert 0 < sync.pttl(keys.worker("p0")) <= reg.ttl_ms and 0 < sync.ttl(keys.workers())
        await reg.stop()  # leaving on purpose: the index goes, the record is a tombstone that lapses
        tombstone = set(sync.hgetall(keys.worker("p0")))
        assert not sync.exists(index) and tombstone == {b"left", b"heartbeat", b"ttl_ms"}  # (no token: unsigned)
        assert 0 < sync.pttl(keys.worker("p0")) <= reg.ttl_ms

    asyncio.run(scenario())
