"""Request migration: the decode worker serving a stream is killed (or stopped) mid-stream; the
router resumes the request on the other decode worker from the prompt plus the tokens already
streamed, and the client's stream is token-identical to an unbroken run: no gap, no repeat."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from tests.support.stack import load, routed_stack

MAX_TOKENS = 1000  # about 2 s of tiny decode on an idle host: room to find and stop it under CI load


@pytest.fixture
def stack(shared_redis_url):
    s = routed_stack(shared_redis_url, 1, 2)
    yield s
    s.stop()


def _busy_decode(stack):
    async def find():
        for d in stack.decodes:
            if (await load(d.address, "decode")).running_requests:
                return d
        return None

    return asyncio.run(find())


class _Saboteur(threading.Thread):
    """Polls the decode workers from before the request is sent and signals the first one found
    running it. Not tied to the client's reads: a client starved of CPU on a loaded host had read
    nothing until the decode had finished (CI, S47, S48)."""

    def __init__(self, stack, sig):
        super().__init__(daemon=True)
        self.stack, self.sig, self.victim, self.done = stack, sig, None, threading.Event()

    def run(self):
        while not self.done.is_set():
            victim = _busy_decode(self.stack)
            if victim is not None:
                victim.signal(self.sig)
                self.victim = victim
                return
            time.sleep(0.005)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_decode_lost_mid_stream_is_migrated_and_the_stream_is_exact(stack, tiny, sig):
    prompt = [(i * 29 + 11) % 256 for i in range(50)]
    want = LLMEngine(tiny, EngineConfig(num_blocks=256)).generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    events, gaps, saboteur = [], [], _Saboteur(stack, sig)
    try:
        with Client(stack.router.address) as c:
            saboteur.start()
            last = time.perf_counter()
            for item in c.generate_streamed(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=60):
                now = time.perf_counter()
                if hasattr(item, "index"):
                    events.append(item)
                    gaps.append(now - last)
                    last = now
                else:
                    result = item
        saboteur.done.set()
        saboteur.join(10)
        victim = saboteur.victim
        assert victim is not None
        assert [e.index for e in events] == list(range(MAX_TOKENS))
        assert [e.token_id for e in events] == want
        assert result.token_ids == want and result.finish_reason == "length"
        assert result.usage["completion_tokens"] == MAX_TOKENS
        assert 0 < result.timings["ttft_ms"] < result.timings["total_ms"]  # the first attempt's first token
        survivor = next(d for d in stack.decodes if d is not victim)
        assert result.route["decode"] == survivor.address
        assert "migrating the request to another decode worker" in stack.router.log()
        assert max(gaps) < 10.0  # a stopped decode is found by keepalive in seconds
        print(f"\nFAULT decode {sig.name} mid-stream: OK (migrated), longest gap {max(gaps):.2f}s, "
              f"{MAX_TOKENS} tokens identical")
        with Client(stack.router.address) as c:  # the pool serves on
            assert c.generate(prompt[:20], max_tokens=5, ignore_eos=True).route["decode"] == survivor.address
    finally:
        saboteur.done.set()
        saboteur.join(10)
        if saboteur.victim is not None and sig == signal.SIGSTOP:
            saboteur.victim.signal(signal.SIGCONT)
    if sig == signal.SIGSTOP:  # resumed, it finds its request gone and gives its pages back

        async def audit():
            for _ in range(100):
                ld = await load(victim.address, "decode")
                if ld.running_requests == 0 and ld.free_kv_blocks == ld.total_kv_blocks:
                    return ld
                await asyncio.sleep(0.1)
            return ld

        ld = asyncio.run(audit())
        assert (ld.running_requests, ld.free_kv_blocks) == (0, ld.total_kv_blocks)
