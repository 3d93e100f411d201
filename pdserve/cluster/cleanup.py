"""Counting and deleting one deployment's keys, by prefix: what `pdserve up` does on exit when it
ran against a Redis it did not start (and what tests use to find a deployment's key plateau).

SCAN, never KEYS: a shared server is not blocked while a large one is walked. Both are bounded
by a deadline, so an exit never hangs on a Redis that stalls.
"""

from __future__ import annotations

import re
import time

import redis

SCAN_COUNT = 500


def _pattern(prefix: str) -> str:
    """The glob matching exactly the keys under `prefix` (glob characters in it escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ":*"


def prefix_keys(url: str, prefix: str, timeout_s: float = 5.0) -> list[str]:
    """Every key under `prefix`, within `timeout_s` (raises TimeoutError past it)."""
    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
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
    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    deleted = 0
    try:
        cursor = 0
        while True:
            cursor, keys = client.scan(cursor, match=_pattern(prefix), count=SCAN_COUNT)
            if keys:
                deleted += client.unlink(*keys)
            if cursor == 0:
                return deleted
            if time.monotonic() > deadline:
                raise TimeoutError(f"deleting the keys under {prefix!r} took over {timeout_s}s")
    finally:
        client.close()
