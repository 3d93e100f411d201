"""A stack whose workers move their KV through the staged path (as GPU workers do), on the CPU
here (on CUDA in scripts/gpu_check.sh, where --device auto finds the GPU): the disaggregated
tokens still equal one CPU engine's, cold, warm and partial, and nothing leaks."""

from __future__ import annotations

import re
import uuid

import pytest

from pdserve.client import Client
from pdserve.engine.device import describe, resolve_device
from pdserve.status_table import render
from tests.support.stack import Stack
from tests.test_disagg import engine, test_disaggregated_equals_single_engine_cold_warm_partial  # noqa: F401

STAGED = ("--kv-path", "staged")


@pytest.fixture(scope="module")
def stack(shared_redis_url):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(
        num_prefill=2, num_decode=1, prefill_flags=STAGED, decode_flags=STAGED)
    yield s
    s.stop()


def test_status_shows_each_workers_device_and_kv_path(stack):
    stack.start_router()
    try:
        stack.wait_pool(3)
        with Client(stack.router.address) as c:
            status = c.status()
        device = describe(resolve_device("auto"))  # the workers' default
        assert sorted((w.role, w.device, w.kv_path) for w in status.workers) == [
            (1, device, "staged"), (1, device, "staged"), (2, device, "staged")]
        rows = render(status).splitlines()
        assert rows[0].split()[:5] == ["ROLE", "ADDRESS", "HEALTH", "DEVICE", "KV"]
        assert all(re.search(rf"\bok\s+{re.escape(device)}\s+staged\s", r) for r in rows[1:4]), rows
    finally:
        stack.router.stop()
        stack.router = None
