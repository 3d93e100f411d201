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


# KEYS: each prefill worker's set of cached hashes, then the store's index hash. ARGV[1]: the chain
# as one string of 32-character hex hashes (one argument instead of n: much less to encode).
# Returns, per key, how many leading hashes of the chain it holds. Caches hold chains prefix-closed
# (a block is cached only after its parent; eviction takes tails first), so presence is monotone
# along the chain and a binary search needs ~log2(n) look-ups per key instead of n (one, for a key
# that lacks the chain's first block).
_LEADING_RUNS = """
local out = {}
local chain = ARGV[1]
local n = #chain / 32
for k = 1, #KEYS do
  local is_hash = (k == #KEYS)
  local function has(i)
    local h = string.sub(chain, (i - 1) * 32 + 1, i * 32)
    if is_hash then return redis.call('HEXISTS', KEYS[k], h) == 1 end
    return redis.call('SISMEMBER', KEYS[k], h) == 1
  end
  local lo, hi = 0, n  -- invariant: the first lo are present; none beyond hi
  if n > 0 and not has(1) then hi = 0 end  -- most keys hold none of the chain: one look-up
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if has(mid) then lo = mid else hi = mid - 1 end
  end
  out[k] = lo
end
return out
"""


class PrefixIndex:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys):
        self.redis = redis
        self.keys = keys
        self._script = redis.register_script(_LEADING_RUNS)

    async def lookup(self, hashes: list[bytes], worker_ids: list[str]) -> PrefixHits:
        """One round trip; Redis itself counts each leading run and returns only the counts."""
        if not hashes:
            return PrefixHits({w: 0 for w in worker_ids}, 0)
        keys = [self.keys.worker_index(w) for w in worker_ids] + [self.keys.store_index()]
        counts = await self._script(keys=keys, args=[b"".join(hashes).hex()])
        return PrefixHits(dict(zip(worker_ids, counts[:-1], strict=True)), counts[-1])

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
