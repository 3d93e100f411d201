"""Bad input at every service that receives it: a clear status, fast, from the service itself;
the service stays healthy, serves the next request exactly, and leaks nothing."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import grpc
import pytest

from pdserve import errors
from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.rpc.convert import profile_to_pb
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from tests.support.credentials import API_KEY, bearer
from tests.support.procs import SERVING, health
from tests.support.stack import Stack, load, prefill_whole, routed_stack, store_stats, stubs

NUM_BLOCKS = 4096  # the workers' default


@pytest.fixture(scope="module")
def stack(shared_redis_url):
    s = routed_stack(shared_redis_url, 1, 1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(tiny, EngineConfig(num_blocks=512))


def ids(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


def expected(engine, prompt, max_tokens=8):
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def _refused(fn) -> tuple[type, str, float]:
    t0 = time.perf_counter()
    with pytest.raises(errors.PdserveError) as err:
        fn()
    return type(err.value), str(err.value), time.perf_counter() - t0


def _healthy_and_clean(stack: Stack, engine) -> None:
    for p in (stack.router, *stack.prefills, *stack.decodes, stack.store):
        assert health(p.address) == SERVING
    with Client(stack.router.address) as c:
        assert c.generate(ids(40, 9), max_tokens=8, ignore_eos=True).token_ids == expected(engine, ids(40, 9))

    async def audit():
        for w, kind in ((stack.prefills[0], "prefill"), (stack.decodes[0], "decode")):
            for _ in range(50):
                ld = await load(w.address, kind)
                if ld.running_requests == 0 and ld.inflight_requests == 0:
                    break
                await asyncio.sleep(0.05)
            assert (ld.running_requests, ld.inflight_requests) == (0, 0)
        for _ in range(50):
            s = await store_stats(stack.store.address)
            if s.active_leases == 0 and not any(t.pinned_blocks for t in s.tiers):
                break
            await asyncio.sleep(0.1)
        assert (s.active_leases, s.watchers, [t.pinned_blocks for t in s.tiers]) == (0, 0, [0, 0])

    asyncio.run(audit())


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", -1.0), ("temperature", 1e9), ("top_p", float("nan")),
                                         ("top_p", 1.5)])
def test_non_finite_and_out_of_range_sampling_is_refused_by_the_router(stack, field, value):
    with Client(stack.router.address) as c:
        cls, msg, seconds = _refused(lambda: c.generate(ids(20, 1), max_tokens=4, **{field: value}))
    assert cls is errors.InvalidArgument and field in msg and seconds < 1.0
    print(f"\nFAULT {field}={value} at the router: INVALID_ARGUMENT in {seconds * 1e3:.0f} ms")


def test_every_worker_refuses_bad_sampling_itself_and_a_forged_first_token(stack, engine):
    nan = common_pb2.SamplingParams(max_tokens=4, temperature=float("nan"))
    prof = profile_to_pb(engine.profile)

    async def calls():
        out = []
        ch, prefill = stubs(stack.prefills[0].address, "prefill")
        async with ch:
            for sampling in (nan, common_pb2.SamplingParams(max_tokens=4, top_p=float("inf"))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill_whole(prefill, prefill_pb2.PrefillRequest(
                        request_id="p-nan", prompt_token_ids=ids(20, 2), sampling=sampling, profile=prof), timeout=5)
                out.append((err.value.code(), err.value.details()))
        ch, decode = stubs(stack.decodes[0].address, "decode")
        async with ch:
            call = decode.Generate(decode_pb2.DecodeRequest(
                request_id="d-nan", prompt_token_ids=ids(20, 2), sampling=nan, profile=prof,
                mode=decode_pb2.DECODE_MODE_COLOCATED), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            out.append((err.value.code(), err.value.details()))
            forged = prefill_pb2.PrefillResponse(request_id="x", first_token=common_pb2.TokenEvent(
                token_id=1, logprob=float("nan")))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await decode.FirstToken(decode_pb2.FirstTokenRequest(request_id="x", prefill=forged), timeout=5)
            out.append((err.value.code(), err.value.details()))
        return out

    results = asyncio.run(calls())
    assert [code for code, _ in results] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert "temperature" in results[0][1] and "top_p" in results[1][1] and "temperature" in results[2][1]
    assert "finite logprob" in results[3][1]
    _healthy_and_clean(stack, engine)


def test_invalid_utf8_prompt_is_invalid_argument(stack, engine):
    from pdserve.v1 import router_pb2

    req = router_pb2.GenerateRequest(text="ABCDEFGH", sampling=common_pb2.SamplingParams(max_tokens=2))
    raw = req.SerializeToString().replace(b"ABCDEFGH", b"\xff\xfe" * 4)
    with grpc.insecure_channel(stack.router.address) as ch:
        call = ch.unary_unary("/pdserve.v1.Router/GenerateUnary", request_serializer=None,
                              response_deserializer=router_pb2.GenerateResult.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(raw, timeout=5, metadata=bearer(API_KEY))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
    _healthy_and_clean(stack, engine)


_BIG_PROMPT = """
import sys, time
from pdserve.client import Client
with Client(sys.argv[1]) as c:
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    try:
        c.generate("x" * (15 << 20), max_tokens=4)
        print("served")
    except Exception as e:
        print(type(e).__name__, time.perf_counter() - t0, str(e)[:200])
"""


def _stream_gaps(address: str, prompt: list[int], on_token=None) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    gaps: list[float] = []
    with Client(address) as c:
        last = None
        for ev in c.stream(prompt, max_tokens=150, ignore_eos=True):
            now = time.perf_counter()
            if last is not None and len(tokens) > 5:
                gaps.append(now - last)
            last = now
            tokens.append(ev.token_id)
            if on_token is not None:
                on_token(len(tokens))
    return tokens, gaps


def test_a_15mb_prompt_is_refused_at_once_and_other_streams_do_not_stall(stack, engine):
    import subprocess
    import sys

    from tests.support.procs import ROOT

    big = subprocess.Popen([sys.executable, "-c", _BIG_PROMPT, stack.router.address], cwd=ROOT,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert big.stdout.readline() == "ready\n"  # started, imported: only the request itself overlaps
    _, quiet = _stream_gaps(stack.router.address, ids(30, 3))  # the same stream alone, this run's noise

    def send(n: int) -> None:
        if n == 5:  # the big prompt arrives while the stream runs (from its own process)
            big.stdin.write("go\n")
            big.stdin.flush()

    got, gaps = _stream_gaps(stack.router.address, ids(30, 3), send)
    out = big.communicate(timeout=60)[0].split(maxsplit=2)
    assert out[0] == "InvalidArgument" and "over this service's limit" in out[2], out
    assert float(out[1]) < 2.0  # moving 15 MB over loopback included
    assert got == expected(engine, ids(30, 3), 150)
    # Under 250 ms (the stall this guards against was 11.7 s; a full suite on 2 cores has shown 122 ms
    # here), or on a machine too busy for that, within twice what the stream alone saw.
    assert max(gaps) < max(0.25, 2 * max(quiet)), f"stalled {max(gaps) * 1e3:.0f} ms, alone {max(quiet) * 1e3:.0f}"
    print(f"\nFAULT 15 MB prompt: INVALID_ARGUMENT in {float(out[1]):.2f}s; other stream's longest gap "
          f"{max(gaps) * 1e3:.0f} ms (alone {max(quiet) * 1e3:.0f} ms)")
    _healthy_and_clean(stack, engine)


def test_a_prompt_that_must_be_over_the_token_limit_is_refused_before_tokenizing(stack, engine):
    with Client(stack.router.address) as c:
        cls, msg, seconds = _refused(lambda: c.generate("x" * 140_000, max_tokens=4))
    assert cls is errors.InvalidArgument and "more than 32768 tokens can cover" in msg and seconds < 1.0


def test_a_duplicate_request_id_is_refused_without_touching_the_first(stack, engine):
    rid = f"dup-{uuid.uuid4().hex[:6]}"
    first: list[int] = []
    started = threading.Event()

    def stream():
        with Client(stack.router.address) as c:
            # (long enough to outlast the moment a request waits for its id: ALREADY_EXISTS then)
            for ev in c.stream(ids(25, 4), request_id=rid, max_tokens=400, ignore_eos=True):
                first.append(ev.token_id)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    with Client(stack.router.address) as c:
        cls, msg, seconds = _refused(lambda: c.generate(ids(25, 5), request_id=rid, max_tokens=4))
    t.join(60)
    assert cls is errors.AlreadyExists and "already in flight" in msg and seconds < 1.0
    print(f"\nFAULT duplicate request_id: ALREADY_EXISTS in {seconds * 1e3:.0f} ms, first request exact")
    assert first == expected(engine, ids(25, 4), 400)
    with Client(stack.router.address) as c:  # the id is free again once the first has ended
        assert c.generate(ids(25, 5), request_id=rid, max_tokens=4, ignore_eos=True).token_ids == expected(
            engine, ids(25, 5), 4)
    _healthy_and_clean(stack, engine)


@pytest.mark.parametrize("rid", ["x~1", "a b", "é", "r" * 129])
def test_a_request_id_the_router_could_confuse_is_refused(stack, rid):
    """'~' is the router's: it names a request's retries and migrations `<id>~<n>` on the workers
    and in the store, so a client's "x~1" would collide with the retry of another's "x"."""
    with Client(stack.router.address) as c:
        cls, msg, seconds = _refused(lambda: c.generate(ids(10, 6), request_id=rid, max_tokens=2))
    assert cls is errors.InvalidArgument and "request_id must be" in msg and seconds < 1.0


def test_a_first_token_for_another_prompt_fails_its_decode_at_once(stack, engine):
    """A handoff whose block hashes are another prompt's (a prefill with other weights, say): its
    blocks never come, so decode refuses it when the first token arrives, not at the end of the
    call's deadline (what a router gives: it waited that long, then said "prefill went silent"),
    and lets the handoff's hold go."""
    prof = profile_to_pb(engine.profile)
    samp = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)

    async def go():
        pch, prefill = stubs(stack.prefills[0].address, "prefill")
        dch, decode = stubs(stack.decodes[0].address, "decode")
        async with pch, dch:
            other = await prefill_whole(prefill, prefill_pb2.PrefillRequest(
                request_id="mm", prompt_token_ids=ids(40, 7), sampling=samp, profile=prof), timeout=30)
            call = decode.Generate(decode_pb2.DecodeRequest(
                request_id="mm", prompt_token_ids=ids(40, 8), sampling=samp, profile=prof,
                mode=decode_pb2.DECODE_MODE_DISAGGREGATED), timeout=8)
            assert (await call.read()).HasField("admitted")
            t0 = time.perf_counter()
            await decode.FirstToken(decode_pb2.FirstTokenRequest(request_id="mm", prefill=other), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            return other.kv_hold_lease_id, err.value.code(), err.value.details(), time.perf_counter() - t0

    hold, code, msg, seconds = asyncio.run(go())
    assert hold and code == grpc.StatusCode.INVALID_ARGUMENT and seconds < 2.0, (code, msg, seconds)
    assert msg == "prefill's block hashes do not match this request's prompt"
    _healthy_and_clean(stack, engine)
