"""Fixtures' helpers for kvstore tests: a store process and an in-process client."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from functools import cache

import redis

from pdserve.cluster.keys import RedisKeys
from pdserve.kvclient.store_client import StoreClient
from pdserve.kvclient.transfer import Transfer
from tests.kv_peer import FINGERPRINT_FLAG, LAYOUT, LAYOUT_FLAG, PROFILE, Buffers, block_data, block_hash, read_back
from tests.support.procs import ROOT, ServiceProcess

BLOCK = LAYOUT.block_nbytes
FENCE_MS = 300  # the test stores' quarantine of abandoned write slots (a long one: a test says so)


# This test process keeps one transfer engine for its life, and the engine caches each peer's
# descriptor by segment name ("host:rpc_port") for its own: a store started later on a port an
# earlier one had would be unreachable to it (measured: every write fails). So each store start
# here takes its transfer ports from a window no earlier start had (Mooncake's default range,
# 15000-17000, stays for every other process). The first window depends on the process id: a
# test run started right after another would otherwise find the first windows' ports in TIME_WAIT,
# which refuses their bind for a minute (seen: every port of a store's window taken). Under
# pytest-xdist each worker process has a range of its own (gw0 from 17100, gw1 from 24500).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_PORT_WINDOWS = itertools.count(17100 + 7400 * _WORKER + 16 * (os.getpid() % 200), 16)


class StoreProcess(ServiceProcess):
    """A store whose every start gets a transfer-port window of its own."""

    def spawn(self) -> StoreProcess:
        low = next(_PORT_WINDOWS)
        if low + 15 > 32000:
            raise RuntimeError("this test process started more stores than it has port windows for")
        self.env = {**self.env, "MC_MIN_RPC_PORT": str(low), "MC_MAX_RPC_PORT": str(low + 15)}
        return super().spawn()


def start_store(redis_url: str, key_prefix: str, device_blocks: int, dram_blocks: int, lease_ms: int = 2000,
                extra: tuple[str, ...] = (), fence_ms: int = FENCE_MS) -> ServiceProcess:
    return StoreProcess(
        "services.kvstore", "--kv-layout", LAYOUT_FLAG, "--model-fingerprint", FINGERPRINT_FLAG,
        "--device-bytes", str(device_blocks * BLOCK), "--dram-bytes", str(dram_blocks * BLOCK),
        "--lease-ms", str(lease_ms), "--redis-url", redis_url, "--key-prefix", key_prefix,
        "--grace-s", "1", "--fence-ms", str(fence_ms), *extra).start()


def peer(op: str, store: str, *flags: str, timeout: float = 60) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.kv_peer", op, "--store", store, *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def spawn_peer(op: str, store: str, *flags: str) -> subprocess.Popen:
    """A peer that prints READY once it holds what it holds; wait for it with `wait_ready`."""
    return subprocess.Popen([sys.executable, "-m", "tests.kv_peer", op, "--store", store, *flags], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()  # before reading its stderr to the end: a live peer would block that forever
        raise AssertionError(f"peer said {line!r} before READY: {proc.communicate()[1][-3000:]}")
    return line


@cache
def transfer() -> Transfer:
    return Transfer()


@cache
def local_buffers() -> Buffers:
    """Registered once per process: registering memory that overlaps a dead registration fails."""
    return Buffers(transfer(), 320)


class LocalClient:
    """A store client in the test process (the store itself runs in another process)."""

    def __init__(self, address: str, timeout_s: float = 5.0):
        self.client = StoreClient(address, PROFILE, transfer(), timeout_s)
        self.buf = local_buffers()
        self.call(StoreClient.connect)

    def call(self, coro_fn, *args, **kwargs):
        """Run one client coroutine on a fresh loop (and a fresh channel, bound to that loop)."""
        async def go():
            try:
                return await coro_fn(self.client, *args, **kwargs)
            finally:
                await self.client.close()
        return asyncio.run(go())

    def put(self, seed: int, indices: list[int], writer_keeps_copy: bool = False):
        for j, i in enumerate(indices):
            self.buf.block(j).copy_(block_data(seed, i))
        hashes = [block_hash(seed, i) for i in indices]
        return self.call(StoreClient.put, hashes, [self.buf.addr(j) for j in range(len(indices))],
                         writer_keeps_copy=writer_keeps_copy)

    def get(self, seed: int, n: int, tail: bool = False) -> dict:
        """Blocks 0..n-1 of `seed` (and its tail) read into zeroed local memory, reported as the
        peer's `get` reports them (`ok`: every block read holds its bytes)."""
        self.buf.tensor.zero_()
        res = self.call(StoreClient.get, [block_hash(seed, i) for i in range(n)], [self.buf.addr(j) for j in range(n)],
                        f"req-{seed}" if tail else "", self.buf.addr(n))
        return read_back(self.buf, seed, 0, n, res)

    def stats(self):
        return self.call(StoreClient.stats)


def tiers_in_redis(redis_url: str, key_prefix: str, seed: int, indices: list[int],
                   timeout_s: float = 3.0, expect: dict | None = None) -> dict[int, str | None]:
    """{index: tier} as the store's index in Redis says; waits for `expect` if given."""
    r = redis.Redis.from_url(redis_url)
    deadline = time.time() + timeout_s
    while True:
        raw = r.hgetall(RedisKeys(key_prefix).store_index())
        got = {i: (raw.get(block_hash(seed, i).hex().encode()) or b"").decode() or None for i in indices}
        if expect is None or got == expect or time.time() > deadline:
            return got
        time.sleep(0.05)


def tier_stats(stats) -> dict[str, dict]:
    return {t.tier: {"used": t.used_blocks, "pinned": t.pinned_blocks, "evictions": t.evictions} for t in stats.tiers}


def wait_for(predicate, timeout_s: float = 5.0) -> float:
    """Poll until `predicate()` holds (failing the test past `timeout_s`); the seconds it took."""
    start = time.time()
    while not predicate():
        assert time.time() - start < timeout_s, "condition not reached in time"
        time.sleep(0.05)
    return time.time() - start
