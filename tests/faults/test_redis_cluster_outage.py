"""A Redis Cluster that stops answering altogether (every node down: redis-py then raises
RedisClusterUnreachableError, which is no RedisError) and comes back empty: a worker's
registration, the store's index, the router's mirror and its hit counters carry on through it,
and are back in Redis (and the mirror) within seconds. A real one-node cluster, killed and
started again on the same port. And a failure none of them expected (a bug, an odd reply) is
logged and tried again: it ends none of them."""

from __future__ import annotations

import asyncio
import time

from pdserve.cluster import connect
from pdserve.cluster.index_mirror import IndexMirror
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.registry import Registration, signature_problem
from pdserve.cluster.store_index import RedisIndex
from pdserve.kv.layout import HashProfile, KVLayout
from tests.support.procs import free_port
from tests.support.redis_cluster import RedisCluster

PROFILE = HashProfile("f" * 64, KVLayout(4, 2, 16, 64, "float32"))
TOKEN = "cluster-outage-token"


def _hash(tag: int, i: int) -> bytes:
    return bytes([tag, i]) + bytes(14)


async def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)


def test_a_cluster_down_then_back_empty_gets_every_index_and_registration_back(key_prefix):
    cluster = RedisCluster(masters=1).start()
    url = cluster.url
    keys = RedisKeys.for_url(url, key_prefix)
    cached = [_hash(1, i) for i in range(8)]
    stored = [(_hash(2, i), "dram") for i in range(5)]

    async def scenario() -> None:
        reg = Registration(url, keys, "p0", "prefill", "127.0.0.1:1", PROFILE, lambda: {"queued_tokens": 0},
                           lambda: list(cached), interval_s=0.25, service_token=TOKEN)
        index = RedisIndex(url, keys, lambda: list(stored))
        mirror = IndexMirror(connect(url, 2.0), keys, block_ms=100)
        counters = PrefixIndex(connect(url, 1.0), keys)
        loops = (reg, index, mirror)
        for loop in loops:
            loop.start()

        async def mirrored() -> bool:
            return (mirror.tailing and mirror.worker_hashes("p0") == frozenset(cached)
                    and mirror.store_hashes() == frozenset(h for h, _ in stored))

        try:
            await _until(mirrored, 5, "mirrored before the outage")
            cluster.kill()
            await counters.record("all", 100, 10, 10)  # written once the cluster is back
            cached.append(_hash(1, 8))  # changes while it is down: the mirror must show them after
            stored.append((_hash(2, 5), "dram"))

            async def down() -> bool:  # (a call to a dead cluster takes redis-py 1-2 s to give up)
                return not (mirror.tailing or reg.connected or index.connected)

            await _until(down, 5, "every loop noticed the dead cluster (one whose task ended claims it is still up)")
            cluster.start()
            check = connect(url, 1.0)

            async def back() -> bool:
                record = {k.decode(): v.decode() for k, v in (await check.hgetall(keys.worker("p0"))).items()}
                worker_set = {bytes.fromhex(m.decode()) for m in await check.smembers(keys.worker_index("p0"))}
                store_set = {bytes.fromhex(m.decode()) for m in await check.hkeys(keys.store_index())}
                return (record.get("address") == "127.0.0.1:1" and not signature_problem(TOKEN, "p0", record)
                        and worker_set == set(cached) and store_set == {h for h, _ in stored})

            await _until(back, 5, "registration and store index rewritten")
            await _until(mirrored, 5, "mirror resynced")
            await asyncio.wait_for(counters.flush(), 5)
            assert (await counters.totals("all"))["lookup_tokens"] == 100
            assert not any(loop._task.done() for loop in loops)
            for loop in loops:
                await loop.stop()
            await check.aclose()
            await counters.redis.aclose()
        finally:
            for loop in loops:  # (failed: whatever stop() would raise must not hide why)
                loop._task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()


def test_a_failure_no_loop_expected_is_tried_again_not_the_end_of_it(shared_redis_url, key_prefix):
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    failures = {"load": 1, "snapshot": 1, "sync": 1}

    def once(name: str, then):
        def call():
            if failures[name]:
                failures[name] -= 1
                raise RuntimeError(f"{name} failed")
            return then()
        return call

    async def scenario() -> None:
        reg = Registration(shared_redis_url, keys, "p0", "prefill", "127.0.0.1:1", PROFILE,
                           once("load", lambda: {"queued_tokens": 0}), lambda: [_hash(1, 0)], interval_s=0.25)
        index = RedisIndex(shared_redis_url, keys, once("snapshot", lambda: [(_hash(2, 0), "dram")]))
        mirror = IndexMirror(connect(shared_redis_url, 2.0), keys, block_ms=100)
        mirror.sync = once("sync", mirror.sync)  # (returns the real sync's coroutine after the failure)
        loops = (reg, index, mirror)
        for loop in loops:
            loop.start()

        async def recovered() -> bool:
            return (reg.connected and index.connected and mirror.tailing
                    and mirror.worker_hashes("p0") == {_hash(1, 0)} and mirror.store_hashes() == {_hash(2, 0)})

        try:
            await _until(recovered, 5, "every loop back after its failure")
            assert failures == {"load": 0, "snapshot": 0, "sync": 0}
            assert not any(loop._task.done() for loop in loops)
        finally:
            for loop in loops:
                await loop.stop()

    asyncio.run(scenario())


def test_a_router_starts_against_a_cluster_no_node_of_which_answers():
    """The router's first pool refresh (before it serves, in services.router.__main__) finds no
    node: it starts, routing by load alone, as against a single Redis that is down."""
    from services.router.workers import WorkerPool

    url = f"redis+cluster://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        pool = WorkerPool(connect(url, 0.5), RedisKeys.for_url(url, "pdtest-nowhere"), PROFILE, 0.25, TOKEN)
        await asyncio.wait_for(pool.refresh(), 5)
        assert not pool.redis_ok and pool.workers == {}
        await pool.stop()
        await pool.redis.aclose()

    asyncio.run(scenario())
