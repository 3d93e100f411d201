"""Counting and deleting one deployment's keys, by prefix: what `pdserve up` does on exit when it
ran against a Redis it did not start (and what tests use to find a deployment's key plateau).

SCAN, never KEYS: a shared server is not blocked while a large one is walked. Both are bounded
by a deadline, so an exit never hangs on a Redis that stalls.
"""

from __future__ import annotations

import re
import time

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
