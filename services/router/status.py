"""The router's Status: pool, Redis, store and hit rates, read fresh on each call. A worker is
listed while the pool holds it (its registration lapsed past its grace: gone from both)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import grpc

from pdserve.cluster import REDIS_DOWN
from pdserve.runtime.server import channel
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, router_pb2
from services.router.router import Router

_ROLE = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}


async def status(router: Router, store_address: str) -> router_pb2.StatusResponse:
    pool = router.pool
    workers = [router_pb2.WorkerStatus(
        address=w.address, role=_ROLE[w.role], healthy=w.usable, refused_reason=w.refused_reason, **w.shown,
        load=common_pb2.WorkerLoad(**{k: int(v) for k, v in w.load.items() if k in _LOAD_FIELDS}))
        for w in sorted(pool.workers.values(), key=lambda w: (w.role, w.worker_id))]
    rates = []
    if pool.redis_ok:
        with contextlib.suppress(TimeoutError):  # the counters this router recorded so far, written
            await asyncio.wait_for(asyncio.shield(router.index.flush()), 0.5)
        try:
            for scope in ["all", "store", *sorted(w.worker_id for w in pool.workers.values() if w.role == "prefill")]:
                t = await router.index.totals(scope)
                lookup, hit = t.get("lookup_tokens", 0), t.get("hit_tokens", 0)
                rates.append(router_pb2.HitRates(scope=scope, hit_tokens=hit, lookup_tokens=lookup,
                                                 ratio=hit / lookup if lookup else 0.0))
        except REDIS_DOWN:
            pool.redis_ok = False
    routing = router.policy.name if pool.redis_ok else "load_only (redis unreachable)"
    return router_pb2.StatusResponse(workers=workers, redis_connected=pool.redis_ok, routing=routing,
                                     hit_rates=rates, store=await _store(store_address),
                                     prefix_index=router.index_source())


_LOAD_FIELDS = ("queued_tokens", "running_requests", "free_kv_blocks", "total_kv_blocks", "inflight_requests")


async def _store(address: str) -> router_pb2.StoreStatus:
    if not address:
        return router_pb2.StoreStatus()
    try:
        async with channel(address) as ch:
            s = await kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=2)
    except grpc.aio.AioRpcError:
        return router_pb2.StoreStatus(address=address, reachable=False)
    dev, dram = s.tiers[0], s.tiers[1]
    return router_pb2.StoreStatus(address=address, reachable=True, device_used_blocks=dev.used_blocks,
                                  device_capacity_blocks=dev.capacity_blocks, dram_used_blocks=dram.used_blocks,
                                  dram_capacity_blocks=dram.capacity_blocks, hits=s.hits, misses=s.misses,
                                  active_leases=s.active_leases)


def store_gauges_shared(address: str, every_s: float = 1.0) -> Callable[[], Awaitable[dict[str, float]]]:
    """`store_gauges`, asked of the store at most once every `every_s`: the scrapes of both
    /metrics ports share one answer (each would otherwise be a call to the store)."""
    asked: list = [0.0, None]  # when, and the call's task

    async def gauges() -> dict[str, float]:
        if asked[1] is None or time.monotonic() - asked[0] >= every_s:
            asked[:] = [time.monotonic(), asyncio.ensure_future(store_gauges(address))]
        return dict(await asyncio.shield(asked[1]))

    return gauges


async def store_gauges(address: str) -> dict[str, float]:
    """The store's transfer and hit counters, for /metrics."""
    if not address:
        return {}
    try:
        async with channel(address) as ch:
            s = await kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=2)
    except grpc.aio.AioRpcError:
        return {"store_up": 0}
    return {"store_up": 1, "store_bytes_written": s.bytes_written, "store_bytes_read": s.bytes_read,
            "store_hit_blocks": s.hits, "store_miss_blocks": s.misses, "store_active_leases": s.active_leases,
            "store_corrupt_blocks": s.corrupt_blocks, "store_fenced_blocks": s.fenced_blocks}
