"""The store killed and restarted (same address), and stopped: requests meanwhile fail fast
with UNAVAILABLE naming the store, and once it is back the stack serves exact tokens again
within a bound that does not grow with the outage's length."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from pdserve import errors
from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.runtime.launch import ServiceProcess, free_port
from tests.support.stack import MIB, Stack

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _store(s: Stack, port: int) -> ServiceProcess:
    return ServiceProcess("services.kvstore", "--model", "tiny", "--port", str(port),
                          "--device-bytes", str(32 * MIB), "--dram-bytes", str(32 * MIB), *s.common()).start()


def _first_success(address: str, prompt: list[int], within_s: float) -> tuple[float, list[int], list[str]]:
    """Seconds until a request succeeds, its tokens, and the errors seen before it."""
    seen: list[str] = []
    t0 = time.perf_counter()
    with Client(address) as c:
        while True:
            try:
                r = c.generate(prompt, max_tokens=6, ignore_eos=True, timeout_s=10)
                return time.perf_counter() - t0, r.token_ids, seen
            except errors.PdserveError as e:
                seen.append(f"{type(e).__name__}: {e}")
                assert time.perf_counter() - t0 < within_s, f"not recovered in {within_s}s: {seen[-3:]}"
                time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(shared_redis_url):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}")
    port = free_port()
    s.store = _store(s, port)
    procs = [s.worker("prefill").spawn(), s.worker("decode").spawn()]
    for p in procs:
        p.wait_ready()
    s.prefills, s.decodes = procs[:1], procs[1:]
    s.start_router()
    s.wait_pool(2)
    s.store_port = port
    yield s
    s.stop()


def test_recovery_after_a_store_restart_does_not_grow_with_the_outage(stack, tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=256))
    recoveries = []
    for n, outage_s in enumerate((1.0, 6.0)):
        prompt = [(i * 7 + n * 31 + 3) % 256 for i in range(40)]
        want = engine.generate([prompt], GREEDY)[0].token_ids
        # The failures before the last recovery marked the prefill down until its next health check;
        # with no prefill usable the router would prefill on decode, which needs no store.
        stack.wait_pool(2)
        stack.store.signal(signal.SIGKILL)
        stack.store.proc.wait(5)
        with Client(stack.router.address) as c:  # meanwhile: a fast, clear refusal
            t0 = time.perf_counter()
            with pytest.raises(errors.Unavailable) as err:
                c.generate(prompt, max_tokens=6, ignore_eos=True, timeout_s=20)
            refused_s = time.perf_counter() - t0
            assert refused_s < 5.0 and "kvstore" in str(err.value), str(err.value)
        time.sleep(outage_s)
        stack.store = _store(stack, stack.store_port)
        took, tokens, _ = _first_success(stack.router.address, prompt, within_s=15)
        assert tokens == want
        recoveries.append(took)
        print(f"\nFAULT kvstore SIGKILL, {outage_s:g}s outage, restart: UNAVAILABLE in {refused_s:.2f}s, "
              f"recovered {took:.2f}s after restart")
    assert recoveries[1] < recoveries[0] + 2.0 and max(recoveries) < 5.0, recoveries


def test_a_stopped_store_fails_requests_fast_and_they_succeed_once_it_resumes(stack, tiny):
    prompt = [(i * 11 + 5) % 256 for i in range(40)]
    want = LLMEngine(tiny, EngineConfig(num_blocks=256)).generate([prompt], GREEDY)[0].token_ids
    stack.wait_pool(2)  # (see above: a prefill marked down would send this request to decode alone)
    stack.store.signal(signal.SIGSTOP)
    try:
        with Client(stack.router.address) as c:
            t0 = time.perf_counter()
            with pytest.raises(errors.Unavailable) as err:
                c.generate(prompt, max_tokens=6, ignore_eos=True, timeout_s=30)
            refused_s = time.perf_counter() - t0
            assert refused_s < 6.0 and "kvstore" in str(err.value), str(err.value)
    finally:
        stack.store.signal(signal.SIGCONT)
    took, tokens, _ = _first_success(stack.router.address, prompt, within_s=15)
    assert tokens == want and took < 5.0
    print(f"\nFAULT kvstore SIGSTOP: UNAVAILABLE in {refused_s:.2f}s, recovered {took:.2f}s after SIGCONT")
