"""A burst ten times what the decode pool can hold: admitted requests get exact tokens, the
rest wait in the bounded admission queue or are refused fast with a retry hint, and nothing
is left held afterwards."""

from __future__ import annotations

import asyncio
import time
import uuid

from pdserve import errors
from pdserve.client import AsyncClient
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from tests.support.stack import Stack, load

MAX_TOKENS = 24
BURST = 60  # each request reserves 4 blocks: the decode worker's 24 hold 6 at once


def test_a_burst_is_served_exactly_or_refused_fast(shared_redis_url, tiny):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(1, 1, decode_flags=("--num-blocks", "24"))
    try:
        s.start_router("--max-queued", "12", "--queue-timeout-s", "1")
        s.wait_pool(2)
        engine = LLMEngine(tiny, EngineConfig(num_blocks=512))
        prompts = [[(i * 17 + n * 5 + 1) % 256 for i in range(40)] for n in range(BURST)]
        want = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))

        async def one(c: AsyncClient, n: int):
            t0 = time.perf_counter()
            try:
                r = await c.generate(prompts[n], max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=60)
                return "ok", r.token_ids == want[n].token_ids, time.perf_counter() - t0, ""
            except errors.ResourceExhausted as e:
                return "refused", None, time.perf_counter() - t0, str(e)

        async def burst():
            async with AsyncClient(s.router.address) as c:
                return await asyncio.gather(*(one(c, n) for n in range(BURST)))

        out = asyncio.run(burst())
        served = [o for o in out if o[0] == "ok"]
        refused = [o for o in out if o[0] == "refused"]
        assert len(served) + len(refused) == BURST
        assert served and all(exact for _, exact, _, _ in served), [o for o in served if not o[1]]
        assert refused and all("retry in about" in msg for *_, msg in refused)
        # At once: a full queue, or a wait the queue's recent rate says would outlast its bound.
        full = [t for _, _, t, msg in refused if "already queued" in msg or "it would wait about" in msg]
        waited = [t for _, _, t, msg in refused if "in the admission queue" in msg]
        assert len(full) + len(waited) == len(refused)
        assert all(t < 1.0 for t in full), full  # refused at once: not after a wait
        assert all(t < 3.0 for t in waited), waited  # the 1 s queue bound, and the machine's noise
        print(f"\nFAULT 10x burst: served {len(served)}, refused at once {len(full)} "
              f"(max {max(full, default=0) * 1e3:.0f} ms), "
              f"after the queue {len(waited)}")

        async def audit():
            for _ in range(50):
                ld = await load(s.decodes[0].address, "decode")
                if ld.running_requests == 0:
                    break
                await asyncio.sleep(0.1)
            return ld

        ld = asyncio.run(audit())
        assert (ld.running_requests, ld.inflight_requests, ld.free_kv_blocks) == (0, 0, 24)
        async def again():  # the pool serves the next request at once
            async with AsyncClient(s.router.address) as c:
                return await c.generate(prompts[0], max_tokens=MAX_TOKENS, ignore_eos=True)

        assert asyncio.run(again()).token_ids == want[0].token_ids
    finally:
        s.stop()


def test_the_ttft_slo_counts_the_wait_before_the_router_took_the_call(shared_redis_url, tiny):
    """The SDK says the timeout it set; what is left of it when the router's handler starts says
    how long the call waited in gRPC's queue before (seconds under overload: docs/perf-log.md,
    S40). The SLO counts that wait: a call that says it set a timeout 5 s longer than gRPC carried
    waited 5 s as far as the router can tell, and is refused at once, the wait in the message; the
    SDK's own calls (no wait here) are served exactly; a timeout that is not a number is refused."""
    import urllib.request

    import grpc

    from pdserve.client import TIMEOUT_KEY, Client, _metadata, _request
    from pdserve.runtime.launch import free_port
    from pdserve.v1 import router_pb2_grpc

    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(1, 1)
    try:
        metrics_port = free_port()
        s.start_router("--ttft-slo-ms", "1000", "--metrics-port", str(metrics_port))
        s.wait_pool(2)
        prompt = [(i * 13 + 7) % 256 for i in range(48)]
        want = LLMEngine(tiny, EngineConfig(num_blocks=256)).generate(
            [prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        with Client(s.router.address) as c:
            assert c.generate(prompt, max_tokens=8, ignore_eos=True, timeout_s=30).token_ids == want

        request = _request("test", prompt, "", {"max_tokens": 8, "ignore_eos": True})
        with grpc.insecure_channel(s.router.address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            def call(says: str) -> tuple[grpc.RpcError, float]:
                t0 = time.perf_counter()
                try:
                    stub.GenerateUnary(request, timeout=30, metadata=(*_metadata(None), (TIMEOUT_KEY, says)))
                except grpc.RpcError as e:
                    return e, time.perf_counter() - t0
                raise AssertionError("served")

            refused, took = call("35000")
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and took < 1.0
            waited = float(refused.details().split(" after ")[1].split(" ms waiting to be admitted")[0])
            assert 4900 <= waited <= 5000 + took * 1e3, refused.details()
            assert "exceeds the SLO 1000 ms; retry in about" in refused.details()
            for says in ("soon", "nan", "-5"):
                bad, _ = call(says)
                assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and TIMEOUT_KEY in bad.details(), says
        with Client(s.router.address) as c:  # and the router serves on
            assert c.generate(prompt, max_tokens=8, ignore_eos=True).token_ids == want
        # Its histogram holds the three calls that said their timeout and parsed: two near 0, one 5 s.
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        seen = dict(line.rsplit(" ", 1) for line in body.splitlines() if line.startswith("pdserve_router_before_"))
        assert float(seen["pdserve_router_before_handler_ms_count"]) == 3
        assert 4900 <= float(seen["pdserve_router_before_handler_ms_sum"]) <= 5000 + 2 * 1e3, seen
    finally:
        s.stop()
