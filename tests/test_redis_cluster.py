"""pdserve on a real 3-master Redis Cluster (redis-server --cluster-enabled yes, joined by
redis-cli --cluster create): the routing, registry and index-mirror tests run here unchanged,
against a `redis+cluster://` URL, and a deployment's keys all live in one slot."""

from __future__ import annotations

import time

import pytest

from pdserve.client import Client
from pdserve.cluster import connect_sync
from pdserve.cluster.cleanup import delete_prefix, prefix_keys
from pdserve.cluster.keys import RedisKeys
from tests.support.redis_cluster import RedisCluster
from tests.support.stack import routed_stack
from tests.test_index_mirror import (  # noqa: F401 - collected here, on the cluster
    test_mirror_follows_workers_and_the_store_exactly_and_answers_as_the_lua_lookup,
    test_mirror_of_two_store_nodes_and_the_cluster_answers_as_the_lua_lookup,
)
from tests.test_registry import test_cache_index_published_as_deltas_and_repaired  # noqa: F401
from tests.test_router_e2e import (  # noqa: F401
    engine,
    ids,
    test_a_new_router_routes_by_the_mirrored_index_as_by_redis,
    test_outputs_equal_the_local_engine_sync_async_streamed_unary,
    test_shared_prefix_goes_to_the_worker_holding_it,
    test_worker_stopped_then_back_and_two_routers,
)


@pytest.fixture(scope="module")
def redis_cluster():
    cluster = RedisCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def shared_redis_url(redis_cluster):
    """This module's Redis is the cluster (the tests imported above take it by this name)."""
    return redis_cluster.url


@pytest.fixture(scope="module")
def stack(shared_redis_url):
    s = routed_stack(shared_redis_url, 2, 1)
    yield s
    s.stop()


def test_a_deployments_keys_share_one_slot_and_leave_with_it(stack, redis_cluster):
    with Client(stack.router.address) as c:
        assert c.generate(ids(100, 50), max_tokens=2, ignore_eos=True).usage["completion_tokens"] == 2
    time.sleep(1.2)  # a heartbeat and a store flush
    keys = RedisKeys.for_url(stack.redis_url, stack.key_prefix)
    assert keys.prefix == "{" + stack.key_prefix + "}"
    found = set(prefix_keys(stack.redis_url, stack.key_prefix))
    want = {keys.workers(), keys.index_events(), keys.store_index()} | {keys.worker(w) for w in _ids(stack)}
    assert want <= found and any(":hits:" in k for k in found)
    r = connect_sync(stack.redis_url, 2.0)
    assert len({r.keyslot(k) for k in found}) == 1
    assert len(redis_cluster.masters_with_keys(keys.prefix + ":*")) == 1
    assert all("cluster_state:ok" in redis_cluster.cli("cluster", "info", port=n.port) for n in redis_cluster.nodes)


def test_cleanup_walks_every_shard(redis_cluster):
    """Keys of one prefix in one slot, of another in another: each cleanup takes exactly its own."""
    r = connect_sync(redis_cluster.url, 2.0)
    mine, theirs = RedisKeys.for_url(redis_cluster.url, "pdtest-mine"), RedisKeys.for_url(redis_cluster.url, "x9")
    for i in range(700):  # (more than one SCAN/UNLINK batch)
        r.set(mine.worker(f"w{i}"), "1")
    r.set(theirs.workers(), "1")
    assert sorted(prefix_keys(redis_cluster.url, "pdtest-mine")) == sorted(mine.worker(f"w{i}") for i in range(700))
    assert delete_prefix(redis_cluster.url, "pdtest-mine") == 700
    assert prefix_keys(redis_cluster.url, "pdtest-mine") == [] and r.get(theirs.workers()) == b"1"
    r.delete(theirs.workers())
    r.close()


def _ids(stack) -> list[str]:
    r = connect_sync(stack.redis_url, 2.0)
    keys = RedisKeys.for_url(stack.redis_url, stack.key_prefix)
    return [w.decode() for w in r.zrange(keys.workers(), 0, -1)]
