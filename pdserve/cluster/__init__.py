"""Everything Redis: keys, the worker registry, index events, the prefix index and its mirror,
the store's index. No other package imports redis; services reach Redis through these.

A URL `redis+cluster://host:port` (or `rediss+cluster://`) names a Redis Cluster by one of its
nodes; every other URL names one server. Both are used the same way: one deployment's keys share
a hash tag on a cluster (pdserve.cluster.keys), so its scripts and transactions run on one shard.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException, RedisError

Redis = aioredis.Redis | aioredis.RedisCluster
# What a call raises when Redis cannot be reached. A cluster client none of whose nodes answers
# raises RedisClusterUnreachableError: a RedisClusterException, which is no RedisError.
REDIS_DOWN = (RedisError, RedisClusterException, OSError)
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    return url.partition("://")[0] in CLUSTER_SCHEMES


def _node_url(url: str) -> str:
    """A cluster URL as redis-py spells one node's."""
    scheme, sep, rest = url.partition("://")
    return CLUSTER_SCHEMES[scheme] + sep + rest


def _open(single, cluster, url: str, timeout_s: float):
    """`single` or `cluster` (a client class), as `url` says, giving up after `timeout_s`."""
    opts = {"socket_timeout": timeout_s, "socket_connect_timeout": min(timeout_s, 0.5)}
    return cluster.from_url(_node_url(url), **opts) if is_cluster(url) else single.from_url(url, **opts)


def connect(url: str, timeout_s: float) -> Redis:
    """A client for `url` whose every call gives up after `timeout_s` (connecting too)."""
    return _open(aioredis.Redis, aioredis.RedisCluster, url, timeout_s)


def connect_sync(url: str, timeout_s: float) -> redis.Redis | redis.RedisCluster:
    """The blocking client for `url` (for what runs outside an event loop: cleanup, tools)."""
    return _open(redis.Redis, redis.RedisCluster, url, timeout_s)


async def transaction(client: Redis):
    """A MULTI/EXEC pipeline. All its keys must share one hash slot on a cluster (a deployment's
    keys do). A cluster client learns its slot map first, on this loop: redis-py queues each
    command of a cluster transaction through a loop of its own, which must find the map known."""
    if isinstance(client, aioredis.RedisCluster):
        await client.initialize()
    return client.pipeline(transaction=True)
