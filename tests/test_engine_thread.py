"""The engine thread under a step that raises (real tiny engine, in process): the step's
requests fail with a clear error, the others keep their exact tokens, and repeated failures
stop the engine for good, every waiter told."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import Unavailable
from pdserve.worker.engine_thread import MAX_FAILED_STEPS, EngineFailed, EngineThread, next_event

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _poisoned() -> SamplingParams:
    """Params no service lets through (validation refuses NaN): here, to make a step raise."""
    p = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    object.__setattr__(p, "temperature", float("nan"))
    return p


async def _tokens(thread: EngineThread, rid: str) -> list[int]:
    q = thread.open_stream(rid)
    out = []
    try:
        while True:
            item = next_event(await asyncio.wait_for(q.get(), 30))
            if hasattr(item, "token_id"):
                out.append(item.token_id)
                if item.finish_reason is not None:
                    return out
    finally:
        thread.close_stream(rid)


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(tiny):
    prompt = [5, 6, 7, 8, 9]
    expected = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0].token_ids

    async def run():
        thread = EngineThread(LLMEngine(tiny, EngineConfig(num_blocks=64)))
        thread.start()
        try:
            bad = asyncio.ensure_future(_tokens(thread, "bad"))
            await thread.call(lambda e: e.add_request("bad", [1, 2, 3], _poisoned()))
            with pytest.raises(EngineFailed, match="the engine failed while running this request"):
                await bad
            # Out of the schedule, its pages kept until its handler aborts it (it may be shipping them).
            assert (await thread.call(lambda e: e.load()))["free_kv_blocks"] == 63
            assert await thread.call(lambda e: e.abort("bad"))
            good = asyncio.ensure_future(_tokens(thread, "good"))
            await thread.call(lambda e: e.add_request("good", prompt, GREEDY))
            assert await good == expected
            assert not thread.dead and thread.failed_steps == 0
            load = await thread.call(lambda e: e.load())
            assert load["running_requests"] == 0 and load["free_kv_blocks"] == 64
        finally:
            thread.stop()

    asyncio.run(run())


def test_steps_failing_in_a_row_stop_the_engine_and_every_waiter_is_told(tiny):
    async def run():
        deaths: list[str] = []
        thread = EngineThread(LLMEngine(tiny, EngineConfig(num_blocks=64)), on_death=deaths.append)
        thread.start()
        try:
            for i in range(MAX_FAILED_STEPS):
                stream = asyncio.ensure_future(_tokens(thread, f"bad{i}"))
                await thread.call(lambda e, i=i: e.add_request(f"bad{i}", [1, 2, 3], _poisoned()))
                with pytest.raises(EngineFailed):
                    await stream
            for _ in range(100):
                if deaths:
                    break
                await asyncio.sleep(0.02)
            assert deaths and "3 steps in a row failed" in deaths[0]
            with pytest.raises(Unavailable, match="engine has stopped"):
                await thread.call(lambda e: e.load())
            with pytest.raises(Unavailable):
                next_event(thread.open_stream("late").get_nowait())
        finally:
            thread.stop()

    asyncio.run(run())


def test_a_head_that_waits_for_pages_does_not_spin_the_engine_thread(tiny):
    """Nothing running, the waiting head short of pages another request holds: each step schedules
    nothing, so the thread waits for a command (only one frees pages) instead of stepping empty
    thousands of times a second, holding the GIL the event loop needs to free them."""
    import time

    from pdserve.engine.config import Role

    async def run():
        thread = EngineThread(LLMEngine(tiny, EngineConfig(num_blocks=4, role=Role.PREFILL)))
        thread.start()
        try:
            held = thread.open_stream("held")
            await thread.call(lambda e: e.add_request("held", list(range(60)), GREEDY))  # 4 pages, kept
            while not hasattr(next_event(await asyncio.wait_for(held.get(), 30)), "token_id"):
                pass
            await thread.call(lambda e: e.add_request("waits", list(range(60)), GREEDY))
            before = thread.steps
            await asyncio.sleep(1.0)
            assert thread.steps - before <= 5  # (at most one empty step per command wait, 0.5 s each)
            assert len(await thread.call(lambda e: e.scheduler.waiting)) == 1
            await thread.call(lambda e: e.release("held"))  # a command: the head is admitted
            t0 = time.monotonic()
            while await thread.call(lambda e: len(e.scheduler.waiting)):
                assert time.monotonic() - t0 < 10
                await asyncio.sleep(0.05)
        finally:
            thread.stop()

    asyncio.run(run())
