"""Deleting and looking for one deployment's keys (what `pdserve up` does against a Redis it did
not start), on a Redis of this test's own: exactly its own keys, and bounded by the deadline
even where none match (the walk over a large Redis then finds nothing for a long time)."""

from __future__ import annotations

import pytest

from pdserve.cluster import connect_sync
from pdserve.cluster.cleanup import delete_prefix, prefix_in_use, prefix_keys


def test_cleanup_takes_exactly_its_own_keys_and_keeps_to_its_deadline(private_redis):
    r = connect_sync(private_redis.url, 2.0)
    others = {f"other:{i}": "1" for i in range(50_000)}
    for i in range(0, len(others), 5_000):
        r.mset(dict(list(others.items())[i : i + 5_000]))
    r.mset({f"mine:{i}": "1" for i in range(1_200)} | {"mine": "1", "mine2:x": "1"})  # (not under "mine:")

    # A deadline already past: each stops at its first page, before it has walked the Redis.
    for call in (prefix_in_use, delete_prefix, prefix_keys):
        with pytest.raises(TimeoutError, match="took over 0s"):
            call(private_redis.url, "nobody", timeout_s=0)
    assert prefix_in_use(private_redis.url, "nobody") is False
    assert delete_prefix(private_redis.url, "nobody") == 0

    assert prefix_in_use(private_redis.url, "mine") is True
    assert sorted(prefix_keys(private_redis.url, "mine")) == sorted(f"mine:{i}" for i in range(1_200))
    assert delete_prefix(private_redis.url, "mine") == 1_200
    assert prefix_keys(private_redis.url, "mine") == []
    assert r.dbsize() == 50_000 + 2 and r.get("mine") == b"1" and r.get("mine2:x") == b"1"
    r.close()
