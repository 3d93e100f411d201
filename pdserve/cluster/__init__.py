"""Everything Redis: keys, the worker registry, index events, the prefix index and its mirror,
the store's index. No other package imports redis; services reach Redis through these."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError

Redis = aioredis.Redis
REDIS_DOWN = (RedisError, OSError)  # what a call raises when Redis cannot be reached


def connect(url: str, timeout_s: float) -> Redis:
    """A client for `url` whose every call gives up after `timeout_s` (connecting too)."""
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 0.5))
