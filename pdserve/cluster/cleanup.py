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


def prefix_keys(url: str, prefix: str, timeout_s: float = 5.0) -> list[str]:
    """Every key under `prefix`, within `timeout_s` (raises TimeoutError past it)."""
    client = connect_sync(url, 1.0)
    prefix = RedisKeys.for_url(url, prefix).prefix  # (a cluster's keys carry it as a hash tag)
    deadline = time.monotonic() + timeout_s
    try:
        out = []
        for key in client.scan_iter(match=_pattern(prefix), count=SCAN_COUNT):
            out.append(key.decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"listing the keys under {prefix!r} took over {timeout_s}s")
        return out
    finally:
        client.close()


def prefix_in_use(url: str, prefix: str, timeout_s: float = 5.0) -> bool:
    """Whether any key lives under `prefix`: SCAN stops at the first. Raises TimeoutError when
    `timeout_s` passes with none found yet (a large Redis), so the caller can refuse rather than guess."""
    client = connect_sync(url, 1.0)
    prefix = RedisKeys.for_url(url, prefix).prefix  # (a cluster's keys carry it as a hash tag)
    deadline = time.monotonic() + timeout_s
    try:
        for keys in _pages(client, _pattern(prefix)):
            if keys:
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(f"looking for keys under {prefix!r} took over {timeout_s}s")
        return False
    finally:
        client.close()


def _pages(client: redis.Redis | redis.RedisCluster, match: str) -> Iterator[list[bytes]]:
    """SCAN's pages, empty ones included, so a caller checks its deadline while none match. (A
    cluster client walks its shards in scan_iter: a page is then one key.)"""
    if isinstance(client, redis.RedisCluster):
        yield from ([key] for key in client.scan_iter(match=match, count=SCAN_COUNT))
        return
    cursor = 0
    while True:
        cursor, keys = client.scan(cursor, match=match, count=SCAN_COUNT)
        yield keys
        if cursor == 0:
            return


def delete_prefix(url: str, prefix: str, timeout_s: float = 5.0) -> int:
    """Deletes every key under `prefix` (UNLINK, in SCAN-sized batches); returns how many. Stops
    at `timeout_s`, raising TimeoutError, or on what Redis raises when it cannot be reached."""
    client = connect_sync(url, 1.0)
    prefix = RedisKeys.for_url(url, prefix).prefix  # (a cluster's keys carry it as a hash tag)
    deadline = time.monotonic() + timeout_s
    deleted = 0
    batch: list[bytes] = []
    try:
        # (One slot on a cluster, so one UNLINK may take many: scan_iter walks every shard.)
        for key in client.scan_iter(match=_pattern(prefix), count=SCAN_COUNT):
            batch.append(key)
            if len(batch) >= SCAN_COUNT:
                deleted += client.unlink(*batch)
                batch = []
            if time.monotonic() > deadline:
                raise TimeoutError(f"deleting the keys under {prefix!r} took over {timeout_s}s")
        if batch:
            deleted += client.unlink(*batch)
        return deleted
    finally:
        client.close()
