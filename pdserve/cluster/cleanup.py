"""Counting and deleting one deployment's keys, by prefix: what `pdserve up` does on exit when it
ran against a Redis it did not start (and what tests use to find a deployment's key plateau).

SCAN, never KEYS: a shared server is not blocked while a large one is walked. Both are bounded
by a deadline, so an exit never hangs on a Redis that stalls.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import redis

from pdserve.cluster import connect_sync
from pdserve.cluster.keys import RedisKeys

SCAN_COUNT = 500


def _pattern(prefix: str) -> str:
    """The glob matching exactly the keys under `prefix` (glob characters in it escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ":*"


def _pages(url: str, prefix: str, timeout_s: float, doing: str) -> Iterator[tuple[redis.Redis, list[bytes]]]:
    """(client, one SCAN page of the keys under `prefix`), empty pages included, so the deadline
    is checked while none match; raises TimeoutError once `timeout_s` has passed. On a cluster
    every key under a prefix carries it as a hash tag, so one slot and one node hold them all:
    only that node is walked (and `client` is the node's own connection)."""
    client = connect_sync(url, 1.0)
    prefix = RedisKeys.for_url(url, prefix).prefix
    match, deadline = _pattern(prefix), time.monotonic() + timeout_s
    try:
        target = client
        if isinstance(client, redis.RedisCluster):
            target = client.get_node_from_key(prefix).redis_connection
        cursor = 0
        while True:
            cursor, keys = target.scan(cursor, match=match, count=SCAN_COUNT)
            yield target, keys
            if cursor == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{doing} the keys under {prefix!r} took over {timeout_s}s")
    finally:
        client.close()


def prefix_keys(url: str, prefix: str, timeout_s: float = 5.0) -> list[str]:
    """Every key under `prefix`, within `timeout_s` (raises TimeoutError past it)."""
    return [key.decode() for _, keys in _pages(url, prefix, timeout_s, "listing") for key in keys]


def prefix_in_use(url: str, prefix: str, timeout_s: float = 5.0) -> bool:
    """Whether any key lives under `prefix`: SCAN stops at the first. Raises TimeoutError when
    `timeout_s` passes with none found yet (a large Redis), so the caller can refuse rather than guess."""
    return any(keys for _, keys in _pages(url, prefix, timeout_s, "looking for"))


def delete_prefix(url: str, prefix: str, timeout_s: float = 5.0) -> int:
    """Deletes every key under `prefix` (UNLINK, a SCAN page at a time); returns how many. Stops
    at `timeout_s`, raising TimeoutError, or on what Redis raises when it cannot be reached."""
    return sum(client.unlink(*keys) for client, keys in _pages(url, prefix, timeout_s, "deleting") if keys)
