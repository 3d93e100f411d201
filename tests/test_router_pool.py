"""The router's worker pool, in memory: what the router keeps per worker goes with the worker."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from pdserve.cluster import connect
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.registry import Registration
from services.router.config import RouterConfig
from services.router.metrics import Metrics
from services.router.policy import Coefficients, PrefillCandidate
from services.router.router import Router
from services.router.workers import WorkerPool, WorkerView
from tests.test_registry import PROFILE


def test_a_worker_the_pool_forgets_leaves_the_routers_per_worker_memories():
    """Worker ids hold a port, so with workers coming and going they never recur: what the router
    keeps per worker (recent routes, up to 65,536 hashes each; when each was last chosen) goes
    when the pool forgets the worker, or would grow without bound."""
    redis = connect("redis://127.0.0.1:1/0", 0.5)  # (never called here)
    pool = WorkerPool(redis, RedisKeys("pdtest-unused"), PROFILE, 1.0)
    router = Router(RouterConfig(), SimpleNamespace(max_token_chars=8), PROFILE, 4096, 256, redis, pool, Metrics())
    for wid in ("p-1", "p-2", "p-3"):
        pool.workers[wid] = WorkerView(wid, "prefill", "unused")
        router.recent.add(wid, [wid.encode() * 4])
        router.policy.choose_prefill([PrefillCandidate(wid, 0, 0, 0)], 16, 0, Coefficients())
    pool._forget("p-1", "left")
    pool._forget("p-2", "registration lapsed")
    assert set(router.recent._by_worker) == set(router.policy._last_chosen) == {"p-3"}


def test_a_crashed_workers_record_lapses_though_request_look_ups_keep_failing(shared_redis_url, key_prefix):
    """A worker whose record is gone (it crashed) leaves the pool once its grace has passed, even
    while the requests' own Redis look-ups keep failing (each sets `redis_ok` false): only a failed
    read of the registry itself restarts the graces. Before, every such failure did, and a
    crashed worker stayed in the pool and in Status for good."""
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)

    async def scenario() -> tuple[float, bool, float]:
        reg = Registration(shared_redis_url, keys, "p0", "prefill", "127.0.0.1:1", PROFILE, load=dict,
                           interval_s=0.2)
        await reg.beat()
        pool = WorkerPool(connect(shared_redis_url, 0.5), keys, PROFILE, 0.1)
        await pool._read_registry()
        assert set(pool.workers) == {"p0"}
        grace_s = pool.workers["p0"].grace_s
        await pool.redis.delete(keys.worker("p0"))  # the worker crashed: its record lapsed
        t0 = time.monotonic()
        while "p0" in pool.workers and time.monotonic() - t0 < grace_s + 2.0:
            pool.redis_ok = False  # a request's look-up failed meanwhile
            await asyncio.sleep(0.1)
            await pool._read_registry()
        await reg.redis.aclose()
        await pool.redis.aclose()
        return grace_s, "p0" in pool.workers, time.monotonic() - t0

    grace_s, still_there, took_s = asyncio.run(scenario())
    assert not still_there and took_s <= grace_s + 0.5


def test_a_tombstone_written_without_the_token_does_not_take_a_worker_out(shared_redis_url, key_prefix):
    """Someone who can write to Redis but lacks the service token writes a live worker's tombstone:
    the router reads it as a missing record (the worker stays for its grace), and the worker's
    next beat mends it. Only a tombstone signed as beats are takes a worker out at once (the
    signed path: test_a_record_written_back_after_its_heartbeat_lapsed_gets_no_call)."""
    from tests.faults.test_auth import FakeDecode, _with_a_live_worker

    async def scenario(r, keys, reg, pool, _other) -> None:
        await reg.beat()
        await pool.refresh()
        assert [w.worker_id for w in pool.usable("decode")] == [reg.worker_id]
        r.delete(keys.worker(reg.worker_id))
        r.hset(keys.worker(reg.worker_id), mapping={"left": str(time.time())})
        await pool.refresh()
        assert [w.worker_id for w in pool.usable("decode")] == [reg.worker_id]  # kept, for its grace
        await reg.beat()
        await pool.refresh()
        assert pool.workers[reg.worker_id].missing_since is None

    _with_a_live_worker(shared_redis_url, key_prefix, FakeDecode(), scenario)
