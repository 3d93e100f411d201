from __future__ import annotations

import pytest

from pdserve.model.loader import LoadedModel, load_model
from tests.support import credentials

credentials.install()  # before any test starts a process: every service runs with auth on

# The longest files first (seconds each, run alone on 2 cores: docs/perf-log.md, S46). pytest-xdist
# hands out whole files in collection order, so a long file collected last would run alone at the end.
LONGEST_FIRST = ("test_kvstore.py", "test_bench_serve.py", "test_router_e2e.py", "test_cluster_tier.py",
                 "test_kv_integrity.py", "test_disagg.py", "faults/test_redis_faults.py", "test_cli.py",
                 "test_up_cli.py", "test_redis_cluster.py")


def pytest_collection_modifyitems(items):
    """Sorted by file, stably: each file's tests stay together and in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny")


import uuid  # noqa: E402

from tests.support.procs import RedisServer, redis_reachable  # noqa: E402


@pytest.fixture(scope="session")
def shared_redis_url():
    """The machine's Redis when reachable (tests use unique key prefixes), else one of our own."""
    if redis_reachable():
        yield "redis://127.0.0.1:6379/0"
        return
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture
def key_prefix() -> str:
    return f"pdtest-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def private_redis():
    """A redis-server only this test uses: safe to stop, slow or flush."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def small_store(shared_redis_url, key_prefix):
    """A store of 4 device + 4 DRAM blocks with 1 s leases, in its own process."""
    from tests.kvstore_support import start_store

    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4, lease_ms=1000)
    yield store
    store.stop()
