"""The store holds a handoff's blocks for its decode (AllocatePutRequest.hold_ms), end to end:
real prefill and decode workers, a real store, Redis and the transfer engine."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import grpc
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kv.layout import HashProfile, KVLayout
from pdserve.kvclient.store_client import StoreClient
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from services.router import dispatch
from services.router.dispatch import FirstFromPrefill, disaggregated
from tests.support.stack import Stack, prefill_whole, run, store_stats, stubs
from tests.test_disagg import B, expected, prompt, sampling


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(tiny, EngineConfig(num_blocks=2048))


def test_a_decode_that_reads_late_still_finds_its_blocks(shared_redis_url, key_prefix, engine, tiny):
    """The store holds a handoff's blocks for its decode: here the decode starts only after other
    puts have filled the store twice over, which would evict them first (handoff copies go first
    once unpinned), and still gets every block. Once it has pulled them the hold is gone."""
    s = Stack(shared_redis_url, key_prefix)
    s.start_store(device_mib=4, dram_mib=4)  # 64 + 64 blocks of the tiny model
    procs = [s.worker("prefill", "--tail-ttl-ms", "20000").spawn(), s.worker("decode").spawn()]
    for proc in procs:
        proc.wait_ready()
    s.prefills, s.decodes = procs[:1], procs[1:]
    ids = prompt(40 * B + 5, salt=91)
    profile = HashProfile(tiny.fingerprint, KVLayout.for_model(tiny.config, B, tiny.dtype))
    try:
        async def go():
            pch, p = stubs(s.prefills[0].address, "prefill")
            dch, d = stubs(s.decodes[0].address, "decode")
            async with pch, dch:
                resp = await prefill_whole(p, prefill_pb2.PrefillRequest(request_id="late", prompt_token_ids=ids,
                                                                         sampling=sampling()), timeout=60)
                assert resp.kv_hold_lease_id
                other = StoreClient(s.store.address, profile, timeout_s=30)
                for fill in range(2):  # 40 held + 1 tail + 80 fit in 128; the second 80 must make room
                    hashes = [bytes([fill, i]) * 8 for i in range(80)]
                    await other.put_bytes(hashes, bytes(80 * profile.layout.block_nbytes))
                await other.close()
                call = d.Generate(decode_pb2.DecodeRequest(
                    request_id="late", prompt_token_ids=ids, sampling=sampling(),
                    mode=decode_pb2.DECODE_MODE_DISAGGREGATED, prefill_timeout_ms=5000), timeout=30)
                assert (await call.read()).HasField("admitted")
                await d.FirstToken(decode_pb2.FirstTokenRequest(request_id="late", prefill=resp), timeout=10)
                tokens = [resp.first_token.token_id]
                while (ev := await call.read()) is not grpc.aio.EOF:
                    if ev.HasField("token") and ev.token.index > 0:
                        tokens.append(ev.token.token_id)
                return tokens

        assert run(go()) == expected(engine, ids)
        deadline = time.time() + 3.0
        while time.time() < deadline and run(store_stats(s.store.address)).active_leases:
            time.sleep(0.1)
        st = run(store_stats(s.store.address))
        assert (st.active_leases, sum(t.pinned_blocks for t in st.tiers)) == (0, 0)
        # The second fill: 23 device blocks demoted (16 DRAM drops for them), then 57 more DRAM
        # drops for its spill; the decode read the tail, which is gone.
        assert [(t.used_blocks, t.evictions) for t in st.tiers] == [(63, 23), (64, 73)]
    finally:
        s.stop()


def test_the_first_token_does_not_wait_for_the_handoff(shared_redis_url, key_prefix, engine, tiny):
    """Prefill hands out its first token the moment it exists, while its handoff is still
    completing: here three of the prompt's blocks are another writer's (allocated, never
    written), so prefill must wait for them before its handoff is done. The first token
    arrives, decode stays waiting for those blocks, and once the other writer lets them go
    prefill puts them itself: the handoff completes and the tokens equal the engine's."""
    import asyncio

    from pdserve.kv.hashing import block_hashes
    from services.router.dispatch import Finished, FirstFromPrefill, disaggregated

    s = Stack(shared_redis_url, key_prefix).start(1, 1)
    ids = prompt(20 * B + 5, salt=93)
    profile = HashProfile(tiny.fingerprint, KVLayout.for_model(tiny.config, B, tiny.dtype))
    try:
        async def go():
            pch, p = stubs(s.prefills[0].address, "prefill")
            dch, d = stubs(s.decodes[0].address, "decode")
            other = StoreClient(s.store.address, profile, timeout_s=30)
            squat = await other.allocate(block_hashes(ids, profile)[5:8], "", "other-writer", lease_ms=60_000)
            events, handoff_at = [], []

            async def request():
                async for ev in disaggregated(p, d, "early-first", ids, sampling(), timeout_s=60,
                                              on_handoff=lambda: handoff_at.append(time.perf_counter())):
                    events.append(ev)

            async with pch, dch:
                task = asyncio.ensure_future(request())
                while not any(isinstance(ev, FirstFromPrefill) for ev in events):
                    assert not task.done(), task
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.5)
                waiting = len(events), (await p.Load(prefill_pb2.LoadRequest(), timeout=5)).inflight_requests
                await other.release(squat.lease_id)
                await asyncio.wait_for(task, 30)
                for _ in range(100):  # (decode may finish before prefill's word that its handoff did)
                    if handoff_at:
                        break
                    await asyncio.sleep(0.1)
            await other.close()
            return events, waiting, handoff_at

        events, (n_events, prefilling), handoff_at = run(go())
        # Half a second after the first token: decode admitted, the first token out, nothing more,
        # and prefill still completing the handoff.
        assert (n_events, prefilling) == (2, 1)
        first = next(ev for ev in events if isinstance(ev, FirstFromPrefill))
        done = events[-1]
        assert isinstance(done, Finished) and handoff_at and handoff_at[0] - first.at >= 0.5, (handoff_at, first.at)
        tokens = [first.response.first_token.token_id] + [ev.token_id for ev in events
                                                          if isinstance(ev, common_pb2.TokenEvent)]
        assert tokens == expected(engine, ids)
    finally:
        s.stop()


def test_a_request_that_ends_at_its_first_token_leaves_no_hold(shared_redis_url, key_prefix, engine, tiny):
    """No decode pulls the blocks of a request whose first token is its last (max_tokens=1): the
    prefill releases the hold itself once its handoff completes, long before its 20 s TTL, and its
    tail, which no one will read, goes at the store's next reap."""
    s = Stack(shared_redis_url, key_prefix)
    s.start_store()
    s.prefills = [s.worker("prefill", "--tail-ttl-ms", "20000").start()]
    ids = prompt(8 * B + 3, salt=95)
    try:
        async def go():
            ch, p = stubs(s.prefills[0].address, "prefill")
            async with ch:
                return await prefill_whole(p, prefill_pb2.PrefillRequest(
                    request_id="one-token", prompt_token_ids=ids, sampling=sampling(max_tokens=1)), timeout=60)

        first = run(go())
        assert first.kv_hold_lease_id and first.first_token.token_id == expected(engine, ids, 1)[0]
        assert first.first_token.finish_reason == common_pb2.FINISH_REASON_LENGTH
        deadline = time.time() + 5.0
        while time.time() < deadline:
            st = run(store_stats(s.store.address))
            if (st.active_leases, sum(t.pinned_blocks for t in st.tiers)) == (0, 0):
                break
            time.sleep(0.1)
        assert (st.active_leases, sum(t.pinned_blocks for t in st.tiers)) == (0, 0)
        assert st.tiers[0].used_blocks + st.tiers[1].used_blocks == 8  # the prompt's full blocks, the tail gone
    finally:
        s.stop()


def test_a_handoff_no_decode_waits_for_lets_its_hold_go(shared_redis_url, key_prefix, engine, tiny):
    """The store's hold on a handoff's blocks, and its tail, go as soon as no decode will pull
    them, not after their TTL (20 s here): a FirstToken for a request the decode does not have
    lets them go, and a request that ends between prefill's first token and decode's (here once
    prefill's handoff is complete) is told to its decode late."""
    s = Stack(shared_redis_url, key_prefix)
    s.start_store()
    procs = [s.worker("prefill", "--tail-ttl-ms", "20000").spawn(), s.worker("decode").spawn()]
    for proc in procs:
        proc.wait_ready()
    s.prefills, s.decodes = procs[:1], procs[1:]

    def held() -> tuple[int, int]:
        deadline = time.time() + 2.0
        while True:
            st = run(store_stats(s.store.address))
            out = (st.active_leases, sum(t.pinned_blocks for t in st.tiers))
            if out == (0, 0) or time.time() > deadline:
                return out
            time.sleep(0.1)

    async def orphan_first_token():
        pch, p = stubs(s.prefills[0].address, "prefill")
        dch, d = stubs(s.decodes[0].address, "decode")
        async with pch, dch:
            first = await prefill_whole(p, prefill_pb2.PrefillRequest(
                request_id="orphan", prompt_token_ids=prompt(5 * B + 2, salt=77), sampling=sampling()), timeout=30)
            before = (await store_stats(s.store.address)).active_leases
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.FirstToken(decode_pb2.FirstTokenRequest(request_id="orphan", prefill=first), timeout=5)
            return first.kv_hold_lease_id, before, e.value.code()

    async def ends_at_prefills_first_token():
        pch, p = stubs(s.prefills[0].address, "prefill")
        dch, d = stubs(s.decodes[0].address, "decode")
        async with pch, dch:
            async with aclosing(disaggregated(p, d, "gone", prompt(3 * B + 1, salt=78), sampling())) as events:
                async for ev in events:
                    if isinstance(ev, FirstFromPrefill):
                        await asyncio.sleep(1.0)  # prefill's handoff completes meanwhile
                        out = ev.response.kv_hold_lease_id, (await store_stats(s.store.address)).active_leases
                        break
            for _ in range(100):  # (the late call runs on this channel: a router's outlives its requests)
                if not dispatch._finishing:
                    return out
                await asyncio.sleep(0.02)
            raise AssertionError("the late FirstToken did not end")

    async def refused_first_token():
        pch, p = stubs(s.prefills[0].address, "prefill")
        dch, d = stubs(s.decodes[0].address, "decode")
        async with pch, dch:
            ids = prompt(4 * B + 3, salt=79)
            call = d.Generate(decode_pb2.DecodeRequest(request_id="nan", prompt_token_ids=ids, sampling=sampling(),
                                                       mode=decode_pb2.DECODE_MODE_DISAGGREGATED), timeout=30)
            assert (await call.read()).HasField("admitted")
            first = await prefill_whole(p, prefill_pb2.PrefillRequest(
                request_id="nan", prompt_token_ids=ids, sampling=sampling()), timeout=30)
            bad = prefill_pb2.PrefillResponse()
            bad.CopyFrom(first)
            bad.first_token.logprob = float("nan")  # (a model that overflowed, say)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.FirstToken(decode_pb2.FirstTokenRequest(request_id="nan", prefill=bad), timeout=5)
            call.cancel()  # (the router fails the request)
            return first.kv_hold_lease_id, e.value.code()

    async def colocated_first_token():  # (a misrouted call: the request prefills on decode itself)
        pch, p = stubs(s.prefills[0].address, "prefill")
        dch, d = stubs(s.decodes[0].address, "decode")
        async with pch, dch:
            ids = prompt(4 * B + 5, salt=80)
            call = d.Generate(decode_pb2.DecodeRequest(request_id="colo", prompt_token_ids=ids,
                                                       sampling=sampling(max_tokens=2000),
                                                       mode=decode_pb2.DECODE_MODE_COLOCATED), timeout=60)
            assert (await call.read()).HasField("admitted")
            first = await prefill_whole(p, prefill_pb2.PrefillRequest(
                request_id="colo", prompt_token_ids=ids, sampling=sampling()), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.FirstToken(decode_pb2.FirstTokenRequest(request_id="colo", prefill=first), timeout=5)
            alive = not call.done()
            call.cancel()
            return first.kv_hold_lease_id, e.value.code(), alive

    try:
        hold, code, alive = run(colocated_first_token())  # (it was accepted, and held until its TTL)
        assert hold and code == grpc.StatusCode.NOT_FOUND and alive
        assert held() == (0, 0)
        hold, code = run(refused_first_token())  # refused: no decode will pull its blocks
        assert hold and code == grpc.StatusCode.INVALID_ARGUMENT
        assert held() == (0, 0)
        hold, before, code = run(orphan_first_token())
        assert hold and before == 1 and code == grpc.StatusCode.NOT_FOUND
        assert held() == (0, 0)
        hold, before = run(ends_at_prefills_first_token())
        assert hold and before == 1  # the hold (decode had pulled every block and consumed the tail)
        assert held() == (0, 0)
    finally:
        s.stop()
