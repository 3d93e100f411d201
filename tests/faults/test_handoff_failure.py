"""A prefill worker lost after its first token reached the client, while its handoff is still
completing: the router migrates the request (re-prefilled elsewhere from the prompt plus the
token already streamed), and the client's stream is token-identical to an unbroken run."""

from __future__ import annotations

import asyncio
import signal
import time

from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.hashing import block_hashes
from pdserve.kv.layout import HashProfile, KVLayout
from pdserve.kvclient.store_client import StoreClient
from tests.support.stack import load, routed_stack

B = 16
MAX_TOKENS = 12


def test_a_prefill_lost_after_the_first_token_is_migrated_and_the_stream_is_exact(shared_redis_url, tiny):
    """Three of the prompt's blocks are another writer's (allocated, never written), so the
    prefill that serves the request cannot complete its handoff: it is killed then, its first
    token already out. The other writer lets them go; the request resumes on the other prefill
    worker and ends exact; decode's pages all come back."""
    prompt = [(i * 31 + 7) % 256 for i in range(20 * B + 5)]
    want = LLMEngine(tiny, EngineConfig(num_blocks=256)).generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    profile = HashProfile(tiny.fingerprint, KVLayout.for_model(tiny.config, B, tiny.dtype))
    stack = routed_stack(shared_redis_url, 2, 1)
    loop = asyncio.new_event_loop()  # the other writer's: its client lives on one loop
    other = StoreClient(stack.store.address, profile, timeout_s=30)
    try:
        squat = loop.run_until_complete(other.allocate(block_hashes(prompt, profile)[5:8], "", "other-writer",
                                                       lease_ms=60_000))

        async def busy_prefill():
            for p in stack.prefills:
                if (await load(p.address, "prefill")).inflight_requests:
                    return p
            return None

        tokens, victim = [], None
        with Client(stack.router.address) as c:
            for item in c.generate_streamed(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=60):
                if not hasattr(item, "index"):
                    result = item
                    continue
                tokens.append(item.token_id)
                if item.index == 0:
                    time.sleep(0.3)  # the handoff is stuck on the other writer's blocks
                    victim = asyncio.run(busy_prefill())
                    victim.signal(signal.SIGKILL)
                    loop.run_until_complete(other.release(squat.lease_id))
        assert victim is not None
        assert tokens == want and result.token_ids == want and result.finish_reason == "length"
        survivor = next(p for p in stack.prefills if p is not victim)
        assert result.route["prefill"] == survivor.address
        assert "prefill failed mid-stream: migrating the request to another prefill worker" in stack.router.log()

        async def audit():
            # The survivor's stream ends just after its HandoffDone is sent, which can be after
            # decode's last token: both sides are polled.
            for _ in range(50):
                ld = await load(stack.decodes[0].address, "decode")
                lp = await load(survivor.address, "prefill")
                if ld.free_kv_blocks == ld.total_kv_blocks and not ld.running_requests and not lp.inflight_requests:
                    break
                await asyncio.sleep(0.1)
            return ld, lp

        d, p = asyncio.run(audit())
        assert (d.running_requests, d.free_kv_blocks, p.inflight_requests) == (0, d.total_kv_blocks, 0)
    finally:
        loop.run_until_complete(other.close())
        loop.close()
        stack.stop()
