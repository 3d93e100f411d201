"""pdserve as a user meets it: router + workers + store + Redis as real processes, SDK clients."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from pdserve import errors
from pdserve.client import AsyncClient, Client, Result
from pdserve.cluster import connect, connect_sync
from pdserve.cluster.cleanup import prefix_keys
from pdserve.cluster.keys import RedisKeys
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import load_model
from tests.support.stack import Stack, load, routed_stack, run, store_stats


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(load_model("tiny"), EngineConfig(num_blocks=2048))


@pytest.fixture(scope="module")
def stack(shared_redis_url):
    s = routed_stack(shared_redis_url, 2, 1)
    yield s
    s.stop()


def ids(n: int, salt: int) -> list[int]:
    return [(i * 53 + salt * 17 + 1) % 256 for i in range(n)]


def expected(engine, prompt_ids, max_tokens=10):
    return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def test_outputs_equal_the_local_engine_sync_async_streamed_unary(stack, engine):
    tok = load_model("tiny").tokenizer
    text = "pdserve routes this prompt through prefill and decode"
    want = expected(engine, tok.encode(text))
    with Client(stack.router.address) as c:
        unary = c.generate(text, max_tokens=10, ignore_eos=True)
        streamed = list(c.stream(text, max_tokens=10, ignore_eos=True))
        by_ids = c.generate(ids(300, 1), max_tokens=10, ignore_eos=True)
    assert unary.token_ids == want and [e.token_id for e in streamed] == want
    assert [e.index for e in streamed] == list(range(10)) and streamed[-1].finish_reason == "length"
    assert unary.text == tok.decode(want) == "".join(e.text for e in streamed)
    assert by_ids.token_ids == expected(engine, ids(300, 1))
    assert unary.usage["prompt_tokens"] == len(tok.encode(text)) and unary.timings["ttft_ms"] > 0
    # Where its TTFT went: decode's admission (prefill is sent then), then prefill's compute.
    t = by_ids.timings
    assert 0 < t["decode_admit_ms"] and t["decode_admit_ms"] + t["prefill_ms"] < t["ttft_ms"], t

    async def with_async():
        async with AsyncClient(stack.router.address) as c:
            r = await c.generate(text, max_tokens=10, ignore_eos=True)
            s = [e.token_id async for e in c.stream(ids(40, 2), max_tokens=10, ignore_eos=True)]
            return r, s

    r, s = asyncio.run(with_async())
    assert r.token_ids == want and s == expected(engine, ids(40, 2))


def test_shared_prefix_goes_to_the_worker_holding_it(stack, engine):
    a = ids(800, 3)
    b = a[:640] + ids(100, 4)
    with Client(stack.router.address) as c:
        before = {h.scope: (h.hit_tokens, h.lookup_tokens) for h in c.status().hit_rates}
        first = c.generate(a, max_tokens=4, ignore_eos=True)
        time.sleep(1.2)  # the worker's heartbeat publishes its cache contents
        second = c.generate(b, max_tokens=4, ignore_eos=True)
        status = c.status()
    assert second.route["prefill"] == first.route["prefill"] and second.route["policy"] == "cache_aware"
    assert second.route["expected_hit_tokens"] == 640
    assert (second.usage["cached_tokens_local"], second.usage["computed_tokens"]) == (640, 100)
    assert second.token_ids == expected(engine, b, 4)
    worker = next(w for w in run(_worker_ids(stack)) if w[1] == first.route["prefill"])[0]
    rates = {h.scope: h for h in status.hit_rates}
    old_hit, old_lookup = before.get(worker, (0, 0))
    assert (rates[worker].hit_tokens - old_hit, rates[worker].lookup_tokens - old_lookup) == (640, 1540)
    r = connect_sync(stack.redis_url, 2.0)
    keys = [k for k in prefix_keys(stack.redis_url, stack.key_prefix) if f":hits:{worker}:" in k]
    assert len(keys) >= 1 and all(0 < r.ttl(k) <= 3600 for k in keys)


def test_a_new_router_routes_by_the_mirrored_index_as_by_redis(stack):
    """Two routers that never saw the first prompt (so no recent-route cache helps them): one
    reads the index from its in-memory mirror, one asks Redis. Both find the cached prefix on the
    same worker."""
    a = ids(800, 13)
    with Client(stack.router.address) as c:
        first = c.generate(a, max_tokens=2, ignore_eos=True)
    time.sleep(1.2)  # the worker's heartbeat publishes its cache contents (and the change event)
    routers = {}
    try:
        for seed, (name, flags) in enumerate((("mirror", ()), ("redis", ("--index-mirror", "false")))):
            routers[name] = Stack(stack.redis_url, stack.key_prefix, store=stack.store)
            routers[name].start_router(*flags)
            routers[name].wait_pool(3)
            with Client(routers[name].router.address) as c:
                deadline = time.time() + 10
                while c.status().prefix_index != name and time.time() < deadline:
                    time.sleep(0.1)
                assert c.status().prefix_index == name
                # Its own suffix: the other router's prompt is cached by now, and would match further.
                route = c.generate(a[:640] + ids(100, 14 + seed), max_tokens=2, ignore_eos=True).route
            assert (route["prefill"], route["expected_hit_tokens"]) == (first.route["prefill"], 640), name
    finally:
        for r in routers.values():
            r.router.stop()


def test_stream_interval_sends_tokens_n_to_a_message(stack, engine):
    """--stream-interval 4: the first token alone, then four to a message, the rest with the
    finish; the SDK hands out the same tokens, one at a time, as from a router streaming each."""
    import grpc

    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
    from tests.support.credentials import API_KEY, bearer

    prompt = ids(90, 21)
    want = expected(engine, prompt, max_tokens=10)
    batched = Stack(stack.redis_url, stack.key_prefix, store=stack.store)
    batched.start_router("--stream-interval", "4")
    try:
        batched.wait_pool(3)
        with grpc.insecure_channel(batched.router.address) as ch:
            request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                                 sampling=common_pb2.SamplingParams(max_tokens=10, ignore_eos=True))
            messages = list(router_pb2_grpc.RouterStub(ch).Generate(request, metadata=bearer(API_KEY), timeout=60))
        shape = [[e.index for e in (m.tokens.events if m.HasField("tokens") else [m.token])]
                 for m in messages[:-1]]
        assert shape == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]] and messages[-1].HasField("summary")
        assert [e.token_id for m in messages[1:3] for e in m.tokens.events] == want[1:9]
        with Client(batched.router.address) as c:
            streamed = list(c.stream(prompt, max_tokens=10, ignore_eos=True))
            result = c.generate(prompt, max_tokens=10, ignore_eos=True)

        async def with_async():
            async with AsyncClient(batched.router.address) as c:
                return [e async for e in c.generate_streamed(prompt, max_tokens=10, ignore_eos=True)]

        items = run(with_async())
        assert [e.token_id for e in streamed] == result.token_ids == want
        assert [e.index for e in streamed] == list(range(10)) and streamed[-1].finish_reason == "length"
        assert [e.token_id for e in items[:-1]] == want and items[-1].token_ids == want
    finally:
        batched.router.stop()


async def _worker_ids(stack):
    r = connect(stack.redis_url, 2.0)
    keys = RedisKeys.for_url(stack.redis_url, stack.key_prefix)
    out = []
    for wid in await r.zrange(keys.workers(), 0, -1):
        addr = await r.hget(keys.worker(wid.decode()), "address")
        out.append((wid.decode(), addr.decode()))
    await r.aclose()
    return out


def test_bad_input_is_refused_by_the_router(stack):
    with Client(stack.router.address) as c:
        before = run(load(stack.decodes[0].address, "decode"))
        cases = [
            (dict(prompt=""), "prompt is empty"),
            (dict(prompt=[]), "prompt is empty"),
            (dict(prompt=[1] * 40000), "accepts at most 32768"),
            (dict(prompt="hi", max_tokens=0), "max_tokens must be "),  # (the SDK's own check)
            (dict(prompt="hi", max_tokens=100000), "over this deployment's cap 4096"),
            (dict(prompt="hi", temperature=-1.0), "temperature must be a number in "),
            (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1]"),
            (dict(prompt=[5, 999]), "outside the vocabulary"),
            (dict(prompt=[1] * 32000, max_tokens=1000), "exceeds the context length"),
        ]
        for kwargs, message in cases:
            prompt = kwargs.pop("prompt")
            with pytest.raises(errors.InvalidArgument, match="INVALID_ARGUMENT") as err:
                c.generate(prompt, **kwargs)
            assert message in str(err.value), (message, str(err.value))
        with pytest.raises(errors.InvalidArgument, match="over this service's limit of 589824 bytes a request"):
            c.generate("x" * (20 * 1024 * 1024), max_tokens=1)  # oversized message
        after = run(load(stack.decodes[0].address, "decode"))
        assert after.inflight_requests == before.inflight_requests == 0
        assert c.generate("still fine", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3


def test_client_cancel_mid_stream_releases_everything(stack):
    with Client(stack.router.address) as c:
        stream = c.stream(ids(500, 9), max_tokens=400, ignore_eos=True)
        got = [next(stream) for _ in range(5)]
        stream.close()
    assert [e.index for e in got] == [0, 1, 2, 3, 4]
    deadline = time.time() + 2.0
    while True:
        d = run(load(stack.decodes[0].address, "decode"))
        ps = [run(load(p.address, "prefill")) for p in stack.prefills]
        st = run(store_stats(stack.store.address))
        state = (d.inflight_requests, d.running_requests, d.free_kv_blocks, [p.inflight_requests for p in ps],
                 st.active_leases, st.watchers)
        if state == (0, 0, 4096, [0, 0], 0, 0) or time.time() > deadline:
            break
        time.sleep(0.05)
    assert state == (0, 0, 4096, [0, 0], 0, 0)


def test_hash_profile_mismatch_is_refused(stack):
    from pdserve.runtime.launch import ServiceProcess

    # A worker of another deployment (block size 32, its own store) registers in the same Redis.
    odd_store = ServiceProcess("services.kvstore", "--model", "tiny", "--block-size", "32",
                               "--device-bytes", str(8 << 20), "--dram-bytes", str(8 << 20), *stack.common()).start()
    odd = ServiceProcess("services.prefill", "--model", "tiny", "--block-size", "32", "--store", odd_store.address,
                         "--heartbeat-s", "0.5", "--threads", "1", *stack.common()).start()
    try:
        deadline = time.time() + 10
        while True:
            with Client(stack.router.address) as c:
                st = c.status()
            refused = [w for w in st.workers if w.address == odd.address]
            if refused and refused[0].refused_reason or time.time() > deadline:
                break
            time.sleep(0.1)
        assert refused and "hash profile differs" in refused[0].refused_reason and not refused[0].healthy
        with Client(stack.router.address) as c:
            for i in range(4):
                assert c.generate(ids(50, 100 + i), max_tokens=2).route["prefill"] != odd.address
    finally:
        odd.stop()
        odd_store.stop()


def test_worker_stopped_then_back_and_two_routers(stack):
    rr = stack.router
    second = Stack(stack.redis_url, stack.key_prefix, store=stack.store)
    second.start_router("--policy", "round_robin")
    try:
        second.wait_pool(3)
        with Client(second.router.address) as c:
            used = {c.generate(ids(20, 200 + i), max_tokens=2).route["prefill"] for i in range(4)}
            assert used == {p.address for p in stack.prefills}
            victim = stack.prefills[1]
            victim.stop()
            second.wait_pool(2)
            routes = [c.generate(ids(20, 300 + i), max_tokens=2, ignore_eos=True) for i in range(4)]
            assert {r.route["prefill"] for r in routes} == {stack.prefills[0].address}
            stack.prefills[1] = stack.worker("prefill").start()
            second.wait_pool(3)
            used = {c.generate(ids(20, 400 + i), max_tokens=2).route["prefill"] for i in range(4)}
            assert used == {p.address for p in stack.prefills}
        with Client(rr.address) as c:  # the first router saw the same changes through Redis
            stack.wait_pool(3)
            assert c.generate("hello", max_tokens=2).usage["completion_tokens"] == 2
    finally:
        second.router.stop()


def test_overload_is_refused_fast(shared_redis_url, key_prefix):
    s = Stack(shared_redis_url, key_prefix)
    s.start_store()
    s.decodes = [s.worker("decode", "--num-blocks", "32").start()]
    s.prefills = [s.worker("prefill").start()]
    s.start_router()
    try:
        s.wait_pool(2)
        with Client(s.router.address) as c:
            c.generate("warm", max_tokens=1)
            t0 = time.perf_counter()
            with pytest.raises(errors.ResourceExhausted, match="no decode worker can admit 63 KV blocks"):
                c.generate([1] * 900, max_tokens=100)
            assert time.perf_counter() - t0 < 0.05
    finally:
        s.stop()


def test_redis_down_routes_by_load_then_recovers(private_redis, key_prefix, engine):
    s = Stack(private_redis.url, key_prefix).start(1, 1)
    s.start_router()
    try:
        s.wait_pool(2)
        with Client(s.router.address) as c:
            assert c.generate(ids(100, 7), max_tokens=4, ignore_eos=True).token_ids == expected(engine, ids(100, 7), 4)
            private_redis.stop()
            deadline = time.time() + 5
            while c.status().redis_connected and time.time() < deadline:
                time.sleep(0.1)
            st = c.status()
            assert not st.redis_connected and st.routing == "load_only (redis unreachable)"
            assert st.prefix_index == ""
            for i in range(3):
                assert c.generate(ids(60, 20 + i), max_tokens=4, ignore_eos=True).token_ids == expected(
                    engine, ids(60, 20 + i), 4)
            private_redis.start()
            deadline = time.time() + 10
            while not c.status().redis_connected and time.time() < deadline:
                time.sleep(0.1)
            s.wait_pool(2)
            st = c.status()
            assert st.redis_connected and st.routing == "cache_aware"
            deadline = time.time() + 10  # the mirror resyncs from Redis on its own clock
            while c.status().prefix_index != "mirror" and time.time() < deadline:
                time.sleep(0.1)
            assert c.status().prefix_index == "mirror"
            a = ids(400, 8)
            c.generate(a, max_tokens=2)
            time.sleep(1.2)
            again = c.generate(a[:320] + ids(40, 9), max_tokens=2)
            assert again.route["expected_hit_tokens"] == 320
    finally:
        s.stop()


def test_generate_streamed_ends_with_result(stack):
    with Client(stack.router.address) as c:
        items = list(c.generate_streamed("abc", max_tokens=3, ignore_eos=True))
    assert isinstance(items[-1], Result) and items[-1].token_ids == [e.token_id for e in items[:-1]]


def test_prometheus_metrics_endpoint(shared_redis_url, key_prefix):
    import urllib.request

    from pdserve.runtime.launch import free_port

    port = free_port()
    s = Stack(shared_redis_url, key_prefix).start(1, 1)
    s.start_router("--metrics-port", str(port))
    try:
        s.wait_pool(2)
        with Client(s.router.address) as c:
            for i in range(3):
                c.generate(ids(40, 60 + i), max_tokens=4, ignore_eos=True)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "pdserve_router_ttft_ms_count 3" in body
        assert 'pdserve_router_itl_ms_bucket{le="+Inf"} 9' in body
        assert "pdserve_router_tpot_ms_count 3" in body and "pdserve_router_route_ms_count 3" in body
        assert "pdserve_router_prompt_tokens_total 120" in body
        assert "pdserve_store_up 1" in body and "pdserve_store_bytes_written" in body
        assert "pdserve_store_corrupt_blocks 0" in body and "pdserve_store_fenced_blocks 0" in body
        # Scrapes within a second share one call to the store (each would be one).
        asked = run(store_stats(s.store.address)).calls["Stats"]
        for _ in range(2):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert run(store_stats(s.store.address)).calls["Stats"] - asked <= 2  # (one of them this look)
        # A caller that connects and sends nothing is let go, not held forever.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            t0 = time.monotonic()
            assert idle.recv(1) == b"" and time.monotonic() - t0 < 8
    finally:
        s.stop()


def test_with_no_prefill_worker_a_request_runs_on_decode_alone_and_counts_its_cache(shared_redis_url, engine):
    """No prefill worker: the router sends each request to a decode worker alone (it prefills
    too). Its usage counts what decode's own cache held: the same prompt again reuses its 4 full
    blocks (it was reported as all computed)."""
    s = routed_stack(shared_redis_url, 0, 1)
    try:
        prompt = ids(77, 9)
        with Client(s.router.address) as c:
            runs = [c.generate(prompt, max_tokens=10, ignore_eos=True) for _ in range(2)]
        assert [r.token_ids for r in runs] == [expected(engine, prompt)] * 2
        assert all(r.route["colocated"] and r.route["decode"] == s.decodes[0].address for r in runs)
        assert [(r.usage["cached_tokens_local"], r.usage["computed_tokens"]) for r in runs] == [(0, 77), (64, 13)]
    finally:
        s.stop()
