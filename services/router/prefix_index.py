"""Prefix look-ups in Redis (which prefix of a hash chain each prefill worker and the store hold)
and the hit-rate counters, per worker and for the store, in time windows."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from pdserve.redis_keys import KEEP_WINDOWS, WINDOW_S, RedisKeys, window_start


@dataclass(frozen=True)
class PrefixHits:
    worker_blocks: dict[str, int]  # leading blocks of the chain each prefill worker caches
    store_blocks: int  # leading blocks of the chain the store holds


def _leading(flags) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


class PrefixIndex:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys):
        self.redis = redis
        self.keys = keys

    async def lookup(self, hashes: list[bytes], worker_ids: list[str]) -> PrefixHits:
        """One round trip: SMISMEMBER per worker set, HMGET on the store's index."""
        if not hashes:
            return PrefixHits({w: 0 for w in worker_ids}, 0)
        hexes = [h.hex() for h in hashes]
        pipe = self.redis.pipeline(transaction=False)
        for wid in worker_ids:
            pipe.smismember(self.keys.worker_index(wid), hexes)
        pipe.hmget(self.keys.store_index(), hexes)
        results = await pipe.execute()
        return PrefixHits({w: _leading(r) for w, r in zip(worker_ids, results[:-1], strict=True)},
                          _leading(results[-1]))

    async def record(self, scope: str, lookup_tokens: int, expected_hit_tokens: int, hit_tokens: int) -> None:
        key = self.keys.hits(scope, window_start())
        pipe = self.redis.pipeline(transaction=False)
        pipe.hincrby(key, "lookup_tokens", lookup_tokens)
        pipe.hincrby(key, "expected_hit_tokens", expected_hit_tokens)
        pipe.hincrby(key, "hit_tokens", hit_tokens)
        pipe.expire(key, WINDOW_S * KEEP_WINDOWS)
        await pipe.execute()

    async def totals(self, scope: str, windows: int = KEEP_WINDOWS) -> dict[str, int]:
        now = window_start()
        pipe = self.redis.pipeline(transaction=False)
        for i in range(windows):
            pipe.hgetall(self.keys.hits(scope, now - i * WINDOW_S))
        out: dict[str, int] = {}
        for rec in await pipe.execute():
            for k, v in rec.items():
                out[k.decode()] = out.get(k.decode(), 0) + int(v)
        return out
