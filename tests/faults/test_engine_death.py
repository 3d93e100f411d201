"""A worker whose engine cannot go on stops serving and exits non-zero for its supervisor, and
the request it held fails with a clear status at once rather than hanging to its deadline."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from pdserve.v1 import common_pb2, decode_pb2
from pdserve.worker.main import EXIT_ENGINE_DEAD
from tests.support.procs import SERVING, health
from tests.support.stack import Stack, stubs

MIB = 1024 * 1024


def test_a_stuck_step_stops_the_worker_and_fails_its_request_fast(shared_redis_url):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}")
    from pdserve.runtime.launch import ServiceProcess

    s.store = ServiceProcess("services.kvstore", "--model", "tiny", "--engine", "mock",
                             "--device-bytes", str(16 * MIB), "--dram-bytes", str(16 * MIB), *s.common()).start()
    # Every step of this decode worker takes a minute: the first one is stuck past its 1 s bound.
    decode = s.worker("decode", "--engine", "mock", "--mock-cost", '{"step_ms": 60000}',
                      "--step-timeout-s", "1").start()
    s.decodes = [decode]
    try:
        assert health(decode.address) == SERVING

        async def generate():
            ch, stub = stubs(decode.address, "decode")
            async with ch:
                call = stub.Generate(decode_pb2.DecodeRequest(
                    request_id="stuck", prompt_token_ids=[1, 2, 3], mode=decode_pb2.DECODE_MODE_COLOCATED,
                    sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=30)
                t0 = time.perf_counter()
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details(), time.perf_counter() - t0
                return None

        code, details, seconds = asyncio.run(generate())
        assert code == grpc.StatusCode.UNAVAILABLE and "engine has stopped" in details and "step has run" in details
        assert seconds < 5.0
        assert decode.proc.wait(10) == EXIT_ENGINE_DEAD
        print(f"\nFAULT engine step stuck: {code.name} in {seconds:.2f}s, worker exit {EXIT_ENGINE_DEAD}")
        assert "worker exiting: its engine stopped" in decode.log()
    finally:
        s.stop()
