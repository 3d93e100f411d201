"""The router's worker pool, in memory: what the router keeps per worker goes with the worker."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.cluster import connect
from pdserve.cluster.keys import RedisKeys
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
