from __future__ import annotations

import pytest

from pdserve.model.loader import LoadedModel, load_model
from tests.support import credentials

credentials.install()  # before any test starts a process: every service runs with auth on


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
