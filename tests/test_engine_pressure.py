"""The engine's scheduling under pressure: an evict hook that fails, and more decodes than a step
has tokens for. Outputs must equal an unpressed engine's, token for token."""

from __future__ import annotations

import dataclasses

from pdserve.engine.config import EngineConfig, Role
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from tests.test_engine import _prefill_export, prompt


def test_an_evict_hook_that_raises_fails_no_step_and_leaks_no_page(tiny):
    """The prefill offloader's hook runs as a cached page is reused for another block. When it
    raised, the step failed inside schedule(), the failure named the previous step's requests,
    and a prefix hit's ref and the evicted page were lost for good. A copy that fails is now a
    later cache miss, nothing more."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first, second = [[(i * 7 + s) % 250 for i in range(40)] for s in (1, 2)]
    want = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate([second], params)[0].token_ids
    engine = LLMEngine(tiny, EngineConfig(num_blocks=4))
    calls = []

    def broken(page: int, block_hash) -> None:
        calls.append(page)
        raise RuntimeError("staging copy failed")

    engine.scheduler.pool.on_evict = broken
    engine.generate([first], params)  # its two full blocks stay cached, evictable
    assert engine.scheduler.pool.num_cached_blocks == 2
    assert engine.generate([second], params)[0].token_ids == want  # needs one of those two pages
    assert len(calls) == 1 and engine.scheduler.pool.num_free_blocks == 4



def test_more_decodes_than_a_steps_tokens_take_turns(tiny):
    """A decode worker activates every handoff it admitted, past what one step has tokens for:
    each step's decodes go to the back, so every sequence moves. Before, the first ones took
    every step and the rest waited for them to finish (with enough running, past deadlines)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [prompt(20 + s, salt=s) for s in range(5)]
    want = [o.token_ids for o in LLMEngine(tiny, EngineConfig(num_blocks=64)).generate(prompts, params)]
    de = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.DECODE, max_num_batched_tokens=4))
    got = {}
    for i, p in enumerate(prompts):
        kv = dataclasses.replace(_prefill_export(tiny, p, params), request_id=f"r{i}")
        got[f"r{i}"] = [de.import_kv(kv, params).token_id]
    early = {}
    for step in range(100):
        if not de.has_work():
            break
        for ev in de.step():
            got[ev.request_id].append(ev.token_id)
        if step == 4:
            early = {rid: len(tokens) for rid, tokens in got.items()}
    assert [got[f"r{i}"] for i in range(5)] == want
    assert min(early.values()) >= 3, early  # (4 tokens a step among 5: none waits its turn out)
