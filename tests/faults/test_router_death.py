"""The router SIGKILLed with streams open: the workers notice (the connection closes, or
keepalive finds it gone) and stop the orphaned requests within seconds, holding nothing."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

from pdserve import errors
from pdserve.client import Client
from pdserve.runtime.server import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from tests.support.stack import load, routed_stack, store_stats


def test_workers_stop_orphaned_streams_when_the_router_dies(shared_redis_url):
    s = routed_stack(shared_redis_url, 1, 1)
    try:
        started = threading.Barrier(4)
        outcomes: list[str] = []

        def stream(n: int) -> None:
            with Client(s.router.address) as c:
                try:
                    for ev in c.stream([(i + n) % 256 for i in range(30)], max_tokens=3000, ignore_eos=True):
                        if ev.index == 5:
                            started.wait(30)
                except errors.PdserveError as e:
                    outcomes.append(type(e).__name__)

        threads = [threading.Thread(target=stream, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        started.wait(30)  # three streams decoding
        s.router.signal(signal.SIGKILL)
        t0 = time.perf_counter()
        for t in threads:
            t.join(30)
        assert outcomes == ["Unavailable"] * 3  # the client sees its router gone, at once

        async def orphans_stopped() -> float:
            bound = 2 * (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
            while time.perf_counter() - t0 < bound + 5:
                d = await load(s.decodes[0].address, "decode")
                st = await store_stats(s.store.address)
                if (d.running_requests, d.inflight_requests, d.free_kv_blocks == d.total_kv_blocks,
                        st.active_leases, st.watchers) == (0, 0, True, 0, 0):
                    return time.perf_counter() - t0
                await asyncio.sleep(0.1)
            raise AssertionError(f"orphans still held: decode {d}, store leases {st.active_leases}")

        took = asyncio.run(orphans_stopped())
        assert took < 2 * (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
        print(f"\nFAULT router SIGKILL, 3 streams open: clients UNAVAILABLE, orphans released in {took:.2f}s")
    finally:
        s.stop()
