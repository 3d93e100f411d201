"""A prefill worker killed (or stopped) before the first token reached the client: the router tries the
request again on the other prefill worker with a fresh handoff, and the client gets exact
tokens with no error. Mock engines (deterministic tokens, a slow prefill to kill mid-way)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid

import pytest

from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.mock_runner import CostModel
from pdserve.engine.sampling import SamplingParams
from pdserve.runtime.launch import ServiceProcess
from tests.support.stack import Stack, load, store_stats

MIB = 1024 * 1024
SLOW = '{"prefill_ms_per_token": 40}'  # a 100-token prompt takes 4 s on p0: time to kill it mid-prefill


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_prefill_lost_before_the_first_token_is_retried_on_another(shared_redis_url, tiny, sig):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}")
    s.store = ServiceProcess("services.kvstore", "--model", "tiny", "--engine", "mock",
                             "--device-bytes", str(16 * MIB), "--dram-bytes", str(32 * MIB), *s.common()).start()
    procs = [s.worker("prefill", "--engine", "mock", "--mock-cost", SLOW, "--worker-id", "p0-slow").spawn(),
             s.worker("prefill", "--engine", "mock", "--worker-id", "p1").spawn(),
             s.worker("decode", "--engine", "mock", "--worker-id", "d0").spawn()]
    for p in procs:
        p.wait_ready()
    s.prefills, s.decodes = procs[:2], procs[2:]
    try:
        s.start_router("--engine", "mock", "--policy", "round_robin")
        s.wait_pool(3)
        prompt = [(i * 13 + 7) % 256 for i in range(100)]
        want = LLMEngine(tiny, EngineConfig(num_blocks=64, mock_cost=CostModel())).generate(
            [prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
        out = {}

        def run():
            with Client(s.router.address) as c:
                out["result"] = c.generate(prompt, max_tokens=12, ignore_eos=True, timeout_s=60)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.time() + 10
        while "prefill failed before the first token" not in s.router.log():
            if asyncio.run(load(s.prefills[0].address, "prefill")).running_requests:
                s.prefills[0].signal(sig)  # mid-prefill: nothing streamed yet (stopped: keepalive finds it)
                break
            assert time.time() < deadline, "the request never reached p0"
            time.sleep(0.05)
        t.join(60)
        assert "result" in out, s.router.log()[-3000:] + s.decodes[0].log()[-3000:] + s.prefills[1].log()[-2000:]
        r = out["result"]
        assert r.token_ids == want and r.finish_reason == "length"
        assert r.route["prefill"] == s.prefills[1].address
        print(f"\nFAULT prefill {sig.name} before the first token: OK (retried), "
              f"ttft {r.timings['ttft_ms'] / 1e3:.2f}s")
        assert "prefill failed before the first token: trying another prefill worker" in s.router.log()
        with Client(s.router.address) as c:  # and the next request is served as usual
            assert c.generate(prompt[:50], max_tokens=4, ignore_eos=True).route["prefill"] == s.prefills[1].address

        async def audit():
            ld = await load(s.decodes[0].address, "decode")
            assert (ld.running_requests, ld.inflight_requests) == (0, 0)
            for _ in range(60):  # the dead writer's lease lapses on its own (2 s)
                st = await store_stats(s.store.address)
                if st.active_leases == 0:
                    break
                await asyncio.sleep(0.1)
            assert (st.active_leases, st.watchers) == (0, 0)

        asyncio.run(audit())
    finally:
        if sig == signal.SIGSTOP:
            s.prefills[0].signal(signal.SIGCONT)
        s.stop()
