"""Prefill and decode workers with the KV handoff through the store: real processes, real store,
real Redis, real transfer engine. Outputs must equal the single engine's, token for token."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.tokenizer import TextStream
from pdserve.rpc.stream_interval import events_of
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from services.router.dispatch import DecodeAdmitted, DispatchError, Finished, FirstFromPrefill, disaggregated
from tests.support.stack import Stack, load, prefill_whole, run, store_stats, stubs

B = 16


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 101 + 5) % 256 for i in range(n)]


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(shared_redis_url):
    import uuid

    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(num_prefill=2, num_decode=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(tiny, EngineConfig(num_blocks=2048))


def expected(engine: LLMEngine, ids: list[int], max_tokens: int = 8) -> list[int]:
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


async def run_one(stack: Stack, rid: str, ids: list[int], prefill_index: int = 0, max_tokens: int = 8,
                  decode_index: int = 0):
    pch, p = stubs(stack.prefills[prefill_index].address, "prefill")
    dch, d = stubs(stack.decodes[decode_index].address, "decode")
    async with pch, dch:
        tokens, first, done = [], None, None
        async for ev in disaggregated(p, d, rid, ids, sampling(max_tokens)):
            if isinstance(ev, DecodeAdmitted):
                assert first is None and not tokens  # decode admits before prefill is sent
            elif isinstance(ev, FirstFromPrefill):
                first = ev
                tokens.append(ev.response.first_token.token_id)
            elif isinstance(ev, Finished):
                done = ev
            else:
                assert ev.index == len(tokens)
                tokens.append(ev.token_id)
        return tokens, first, done


async def baseline(stack: Stack) -> dict:
    d = await load(stack.decodes[0].address, "decode")
    ps = [await load(p.address, "prefill") for p in stack.prefills]
    s = await store_stats(stack.store.address)
    return {"decode_free": d.free_kv_blocks, "decode_inflight": d.inflight_requests, "decode_running":
            d.running_requests, "prefill_inflight": [p.inflight_requests for p in ps],
            "prefill_free": [p.free_kv_blocks for p in ps], "store_leases": s.active_leases,
            "store_pinned": sum(t.pinned_blocks for t in s.tiers), "store_watchers": s.watchers}


CLEAN = {"decode_inflight": 0, "decode_running": 0, "prefill_inflight": [0, 0], "store_leases": 0,
         "store_pinned": 0, "store_watchers": 0}


def assert_clean(stack: Stack, timeout_s: float = 3.0) -> None:
    deadline = time.time() + timeout_s
    while True:
        b = run(baseline(stack))
        got = {k: b[k] for k in CLEAN}
        full = b["decode_free"] == 4096 and b["prefill_free"] == [4096, 4096]
        if (got == CLEAN and full) or time.time() > deadline:
            assert got == CLEAN
            assert b["decode_free"] == 4096 and b["prefill_free"] == [4096, 4096]
            return
        time.sleep(0.1)


LENGTHS = [1, B - 1, B, B + 1, 3 * B + 5, 2000]


@pytest.mark.parametrize("n", LENGTHS)
def test_disaggregated_equals_single_engine_cold_warm_partial(stack, engine, n):
    ids = prompt(n, salt=n)
    want = expected(engine, ids)
    tokens, first, _ = run(run_one(stack, f"cold-{n}", ids, prefill_index=0))
    assert tokens == want
    u = first.response.usage
    assert (u.cached_tokens_local, u.cached_tokens_store, u.computed_tokens) == (0, 0, n)
    # Warm store: the other prefill worker has never seen it, so every loadable block comes from the store.
    tokens, first, _ = run(run_one(stack, f"warm-{n}", ids, prefill_index=1))
    assert tokens == want
    loadable = min(n // B * B, n - 1)  # every full block is loaded; the last token is always computed
    u = first.response.usage
    assert (u.cached_tokens_local, u.cached_tokens_store, u.computed_tokens) == (0, loadable, n - loadable)
    # Partial hit: a new prompt sharing the first half, again on a worker that only the store can help.
    if n >= 2 * B:
        half = n // 2 // B * B
        ids2 = ids[:half] + prompt(n - half, salt=999)
        tokens, first, _ = run(run_one(stack, f"partial-{n}", ids2, prefill_index=1))
        assert tokens == expected(engine, ids2)
        assert first.response.usage.cached_tokens_local + first.response.usage.cached_tokens_store == half
    assert_clean(stack)


def test_32_concurrent_mixed_lengths_all_exact(stack, engine):
    rng = random.Random(7)
    cases = [(f"c{i}", prompt(rng.randint(1, 300), salt=1000 + i)) for i in range(32)]
    want = {rid: expected(engine, ids) for rid, ids in cases}

    async def all_of_them():
        results = await asyncio.gather(*(run_one(stack, rid, ids) for rid, ids in cases))
        return {rid: r[0] for (rid, _), r in zip(cases, results, strict=True)}

    assert run(all_of_them()) == want
    assert_clean(stack)


def test_first_token_comes_from_prefill_before_decode_continues(stack, engine):
    ids = prompt(700, salt=3)

    async def go():
        pch, p = stubs(stack.prefills[0].address, "prefill")
        dch, d = stubs(stack.decodes[0].address, "decode")
        async with pch, dch:
            times = []
            async for ev in disaggregated(p, d, "first-tok", ids, sampling()):
                times.append((type(ev).__name__, time.perf_counter(), ev))
            return times

    times = run(go())
    kinds = [k for k, _, _ in times]
    assert kinds[:2] == ["DecodeAdmitted", "FirstFromPrefill"] and kinds[-1] == "Finished"
    first = times[1][2].response
    assert [first.first_token.token_id] + [e.token_id for k, _, e in times if k == "TokenEvent"] == expected(
        engine, ids)
    # Prefill's own timings show the handoff overlapped compute; decode learned the token after P had it.
    assert first.timings.prefill_ms > 0 and times[1][1] <= times[2][1]
    done = times[-1][2].done
    # The pull's wait counts from the first token's arrival at decode: part of decode's time after it.
    assert 0 <= done.timings.pull_wait_ms < done.timings.total_ms and done.usage.completion_tokens == 8


def test_cancel_at_random_points_leaks_nothing(stack):
    rng = random.Random(11)

    async def one(i: int):
        ids = prompt(rng.choice([5, 40, 300, 900]), salt=5000 + i)
        delay = rng.choice([0.0, 0.001, 0.02, 0.1, 0.3])
        task = asyncio.ensure_future(run_one(stack, f"x{i}", ids, prefill_index=i % 2, max_tokens=64))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def all_of_them():
        for i in range(100):
            await one(i)

    run(all_of_them())
    assert_clean(stack, timeout_s=5.0)


def _code(coro) -> tuple[grpc.StatusCode, str]:
    try:
        run(coro)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    except DispatchError as e:
        return e.code, str(e)
    raise AssertionError("expected an error")


def test_bad_input_at_each_rpc(stack):
    INVALID = grpc.StatusCode.INVALID_ARGUMENT

    async def prefill(**kw):
        ch, p = stubs(stack.prefills[0].address, "prefill")
        async with ch:
            base = dict(request_id="bad", prompt_token_ids=[1, 2, 3], sampling=sampling())
            return await prefill_whole(p, prefill_pb2.PrefillRequest(**{**base, **kw}), timeout=10)

    async def decode(**kw):
        ch, d = stubs(stack.decodes[0].address, "decode")
        async with ch:
            base = dict(request_id="bad", prompt_token_ids=[1, 2, 3], sampling=sampling(),
                        mode=decode_pb2.DECODE_MODE_DISAGGREGATED)
            return [e async for e in d.Generate(decode_pb2.DecodeRequest(**{**base, **kw}), timeout=10)]

    async def first_token(rid):
        ch, d = stubs(stack.decodes[0].address, "decode")
        async with ch:
            resp = prefill_pb2.PrefillResponse(request_id=rid)
            return await d.FirstToken(decode_pb2.FirstTokenRequest(request_id=rid, prefill=resp), timeout=5)

    assert _code(prefill(prompt_token_ids=[])) == (INVALID, "prompt is empty: give at least one token")
    assert _code(decode(prompt_token_ids=[])) == (INVALID, "prompt is empty: give at least one token")
    code, msg = _code(prefill(prompt_token_ids=[1] * 32768))
    assert code == INVALID and "exceeds the context length 32768" in msg
    code, msg = _code(decode(sampling=common_pb2.SamplingParams(max_tokens=0)))
    assert code == INVALID and "max_tokens must be >= 1" in msg
    code, msg = _code(prefill(sampling=common_pb2.SamplingParams(max_tokens=4, temperature=-1)))
    assert code == INVALID and "temperature must be a number in " in msg
    code, msg = _code(prefill(prompt_token_ids=[1, 300]))
    assert code == INVALID and "outside the vocabulary" in msg
    code, msg = _code(decode(mode=decode_pb2.DECODE_MODE_UNSPECIFIED))
    assert code == INVALID and "mode is required" in msg
    assert _code(decode(stream_interval=257)) == (INVALID, "stream_interval must be at most 256, got 257")
    code, msg = _code(prefill(request_id=""))
    assert code == INVALID and "request_id is required" in msg
    wrong = common_pb2.HashProfile(model_fingerprint="0" * 64, layout=common_pb2.KVLayout(
        num_layers=4, num_kv_heads=2, block_size=16, head_dim=64, dtype="float32"))
    code, msg = _code(prefill(profile=wrong))
    assert code == INVALID and "hash profile mismatch: model fingerprint differs" in msg
    code, msg = _code(decode(profile=wrong))
    assert code == INVALID and "hash profile mismatch" in msg
    code, msg = _code(first_token("nobody"))
    assert code == grpc.StatusCode.NOT_FOUND and "no request 'nobody'" in msg
    assert_clean(stack)
    tokens, _, _ = run(run_one(stack, "after-bad", prompt(20)))
    assert len(tokens) == 8


def test_decode_admission_refuses_at_once_when_pages_are_short(shared_redis_url, key_prefix):
    s = Stack(shared_redis_url, key_prefix)
    s.start_store()
    s.decodes = [s.worker("decode", "--num-blocks", "64").start()]
    try:
        async def go():
            ch, d = stubs(s.decodes[0].address, "decode")
            async with ch:
                def req(rid, n_tokens):
                    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt(n_tokens),
                                                    sampling=sampling(100), mode=decode_pb2.DECODE_MODE_DISAGGREGATED)
                holder = d.Generate(req("holder", 500), timeout=30)
                assert (await holder.read()).admitted.reserved_blocks == 38  # 500 + 100 - 1 slots
                t0 = time.perf_counter()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await d.Generate(req("second", 500), timeout=30).read()
                refused_in = time.perf_counter() - t0
                with pytest.raises(grpc.aio.AioRpcError) as too_big:
                    await d.Generate(req("huge", 1200), timeout=30).read()
                holder.cancel()
                return err.value, refused_in, too_big.value

        err, refused_in, too_big = run(go())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "decode worker full: 26 free KV pages, request needs 38; retry later" in err.details()
        assert refused_in < 1.0
        assert too_big.code() == grpc.StatusCode.INVALID_ARGUMENT and "engine has only 64" in too_big.details()
        time.sleep(0.3)
        d = run(load(s.decodes[0].address, "decode"))
        assert (d.free_kv_blocks, d.inflight_requests) == (64, 0)
    finally:
        s.stop()


async def start_by_hand(p, d, rid: str, ids: list[int]):
    """Decode admitted (its stream open), prefill running: the router's part, done by the test so
    it can kill one side in the middle. (Decode would wait for prefill to its call's deadline,
    the router cancelling it when prefill fails; by hand, the caller bounds the wait itself.)"""
    call = d.Generate(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling(),
                                               mode=decode_pb2.DECODE_MODE_DISAGGREGATED, prefill_timeout_ms=2000),
                      timeout=30)
    assert (await call.read()).HasField("admitted")
    pre = asyncio.ensure_future(prefill_whole(p, prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ids, sampling=sampling()), timeout=60))
    return call, pre


def test_prefill_killed_decode_reports_unavailable_and_frees(shared_redis_url, key_prefix):
    s = Stack(shared_redis_url, key_prefix).start(1, 1)
    try:
        async def go():
            pch, p = stubs(s.prefills[0].address, "prefill")
            dch, d = stubs(s.decodes[0].address, "decode")
            async with pch, dch:
                call, pre = await start_by_hand(p, d, "k1", prompt(6000, salt=77))
                await asyncio.sleep(0.5)
                s.prefills[0].proc.kill()
                t0 = time.perf_counter()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                elapsed = time.perf_counter() - t0
                await asyncio.gather(pre, return_exceptions=True)
                return err.value.code(), err.value.details(), elapsed

        code, msg, elapsed = run(go())
        assert code == grpc.StatusCode.UNAVAILABLE and "prefill went silent" in msg
        assert elapsed < 5.0
        d = run(load(s.decodes[0].address, "decode"))
        assert (d.free_kv_blocks, d.inflight_requests, d.running_requests) == (4096, 0, 0)
        assert run(store_stats(s.store.address)).watchers == 0
    finally:
        s.stop()


def test_decode_killed_store_leases_lapse_prefill_unaffected(shared_redis_url, key_prefix, engine):
    s = Stack(shared_redis_url, key_prefix).start(1, 1)
    try:
        async def go():
            pch, p = stubs(s.prefills[0].address, "prefill")
            dch, d = stubs(s.decodes[0].address, "decode")
            async with pch, dch:
                call, pre = await start_by_hand(p, d, "k2", prompt(3000, salt=78))
                await asyncio.sleep(0.3)
                s.decodes[0].proc.kill()
                resp = await pre
                return resp

        resp = run(go())
        assert resp.first_token.token_id == expected(engine, prompt(3000, salt=78))[0]
        deadline = time.time() + 3.0 + 2.0  # lease TTL 3 s in this stack
        while run(store_stats(s.store.address)).active_leases and time.time() < deadline:
            time.sleep(0.1)
        st = run(store_stats(s.store.address))
        assert st.active_leases == 0 and sum(t.pinned_blocks for t in st.tiers) <= 1  # at most the tail's TTL pin
        p = run(load(s.prefills[0].address, "prefill"))
        assert (p.free_kv_blocks, p.inflight_requests) == (4096, 0)
    finally:
        s.stop()


def test_decode_reuses_its_own_prefix_cache_and_colocated_mode(stack, engine):
    ids = prompt(100, salt=4242)
    want = expected(engine, ids)
    tokens, _, done = run(run_one(stack, "turn1", ids))
    assert tokens == want and done.admitted.local_hit_blocks == 0
    # Same prompt again: decode's own cache already holds all 6 full blocks; only the tail is pulled.
    tokens, _, done = run(run_one(stack, "turn2", ids, prefill_index=1))
    assert tokens == want and done.admitted.local_hit_blocks == 6

    colo_prompt = [(i * 11 + 3) % 256 for i in range(77)]  # in no other test's prompt (prompt()'s salt is mod 256)

    async def colocated(request_id: str, stream_interval: int = 0):
        ch, d = stubs(stack.decodes[0].address, "decode")
        async with ch:
            call = d.Generate(decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=colo_prompt, sampling=sampling(),
                mode=decode_pb2.DECODE_MODE_COLOCATED, stream_interval=stream_interval), timeout=30)
            return [e async for e in call]

    events = run(colocated("colo"))
    assert events[0].HasField("admitted") and events[-1].HasField("done")
    assert [e.token.token_id for e in events if e.HasField("token")] == expected(engine, colo_prompt)
    assert events[-1].done.usage.completion_tokens == 8 and events[-1].done.usage.cached_tokens_local == 0
    # Three tokens to a message: the first alone (at once), the last closing its message.
    events = run(colocated("colo-3", stream_interval=3))
    assert [[t.index for t in events_of(e)] for e in events[1:-1]] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert [t.token_id for e in events for t in events_of(e)] == expected(engine, colo_prompt)
    assert events[0].HasField("admitted") and events[-1].done.usage.completion_tokens == 8
    assert events[-1].done.usage.cached_tokens_local == 64  # the same prompt: its 4 full blocks reused
    assert_clean(stack)


def test_decode_text_follows_its_tokens_in_order(stack, engine, tiny):
    """Decode's text for tokens 1.. continues the first token's: the first token, activated on the
    engine thread, is detokenized before any token the engine produced after it."""
    tok = tiny.tokenizer

    async def one(i: int) -> tuple[list[int], str]:
        pch, p = stubs(stack.prefills[0].address, "prefill")
        dch, d = stubs(stack.decodes[0].address, "decode")
        async with pch, dch:
            tokens, text = [], ""
            async for ev in disaggregated(p, d, f"text-{i}", prompt(40 + i, salt=300 + i), sampling(12)):
                if isinstance(ev, FirstFromPrefill):
                    tokens.append(ev.response.first_token.token_id)
                elif isinstance(ev, common_pb2.TokenEvent):
                    tokens.append(ev.token_id)
                    text += ev.text
            return tokens, text

    for i in range(6):
        tokens, text = run(one(i))
        assert tokens == expected(engine, prompt(40 + i, salt=300 + i), 12)
        want = TextStream(tok)
        want.push(tokens[0])
        assert text == "".join(want.push(t) for t in tokens[1:]) + want.flush()
    assert_clean(stack)

