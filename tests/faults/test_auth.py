"""Each attack of issue 20 without credentials (refused, with the exact status, at once) and with
them (the call works): clients without or with a wrong API key, an API key on internal RPCs,
forged FirstToken / Cancel / AllocatePut / Watch without the service token, and a fake decode
worker written into Redis, which must receive no prompt unless its registration is signed with
the deployment's token. Real processes, the shared Redis under a key prefix of its own."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent import futures

import grpc
import pytest
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import errors
from pdserve.client import Client
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.registry import sign
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.support.credentials import API_KEY, SERVICE_METADATA, bearer
from tests.support.stack import Stack, run, store_stats

UNAUTHENTICATED, PERMISSION_DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
PROMPT = [(i * 31 + 7) % 256 for i in range(40)]


@pytest.fixture(scope="module")
def stack(shared_redis_url):
    s = Stack(shared_redis_url, f"pdtest-auth-{uuid.uuid4().hex[:8]}").start(num_prefill=1, num_decode=1)
    s.start_router()
    s.wait_pool(2)
    yield s
    s.stop()


def code_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, float]:
    """The status a call ends with, and how long it took to get it."""
    start = time.perf_counter()
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):  # a response stream: read it to its end
            list(result)
    except grpc.RpcError as e:
        return e.code(), time.perf_counter() - start
    return grpc.StatusCode.OK, time.perf_counter() - start


def internal_calls(s: Stack):
    """(name, callable(metadata) -> status) for an internal RPC of each kind an attacker would use."""
    dec = grpc.insecure_channel(s.decodes[0].address)
    pre = grpc.insecure_channel(s.prefills[0].address)
    sto = grpc.insecure_channel(s.store.address)
    d, p, k = decode_pb2_grpc.DecodeStub(dec), prefill_pb2_grpc.PrefillStub(pre), kvstore_pb2_grpc.KVStoreStub(sto)
    forged = decode_pb2.FirstTokenRequest(request_id="someone-elses", prefill=prefill_pb2.PrefillResponse(
        request_id="someone-elses", first_token=common_pb2.TokenEvent(token_id=7)))
    profile = k.Info(kvstore_pb2.InfoRequest(), timeout=5, metadata=SERVICE_METADATA).profile
    calls = {
        "FirstToken": lambda md: code_of(d.FirstToken, forged, timeout=5, metadata=md),
        "Cancel(decode)": lambda md: code_of(d.Cancel, prefill_pb2.CancelRequest(request_id="x"), timeout=5,
                                             metadata=md),
        "Cancel(prefill)": lambda md: code_of(p.Cancel, prefill_pb2.CancelRequest(request_id="x"), timeout=5,
                                              metadata=md),
        "AllocatePut": lambda md: code_of(k.AllocatePut, kvstore_pb2.AllocatePutRequest(
            profile=profile, block_hashes=uuid.uuid4().bytes, lease_ms=500), timeout=5,
            metadata=(("pdserve-client-id", "t"), *md)),
        "Watch": lambda md: code_of(k.Watch, kvstore_pb2.WatchRequest(
            profile=profile, block_hashes=uuid.uuid4().bytes, lease_ms=500), timeout=0.5,
            metadata=(("pdserve-client-id", "t"), *md)),
    }
    return calls, (dec, pre, sto)


def test_internal_rpcs_refuse_callers_without_the_service_token(stack):
    calls, channels = internal_calls(stack)
    try:
        for name, call in calls.items():
            for md in ((), bearer("not-the-token"), (("authorization", "Basic abc"),)):
                code, took = call(md)
                assert code == UNAUTHENTICATED, (name, md, code)
                assert took < 1.0, (name, took)
            code, _ = call(bearer(API_KEY))  # a client's key is known, but not allowed here
            assert code == PERMISSION_DENIED, (name, code)
        # With the service token each call reaches its handler and gets the handler's own answer.
        answers = {name: call(SERVICE_METADATA)[0] for name, call in calls.items()}
        assert answers == {"FirstToken": grpc.StatusCode.NOT_FOUND, "Cancel(decode)": grpc.StatusCode.OK,
                           "Cancel(prefill)": grpc.StatusCode.OK, "AllocatePut": grpc.StatusCode.OK,
                           "Watch": grpc.StatusCode.DEADLINE_EXCEEDED}  # (a watch waits for its blocks)
    finally:
        for ch in channels:
            ch.close()



def test_calls_to_methods_that_do_not_exist_leave_nothing_behind(stack):
    """A caller without a credential naming methods at random (each its own long name) gets
    UNIMPLEMENTED, and the store keeps nothing of them: its per-method call counts covered every
    name asked for, and grew by about 4 KB a call."""
    with grpc.insecure_channel(stack.store.address) as ch:
        for i in range(50):
            call = ch.unary_unary(f"/pdserve.v1.KVStore/Nope{i}{'x' * 2000}")
            with pytest.raises(grpc.RpcError) as e:
                call(b"", timeout=5)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    calls = run(store_stats(stack.store.address)).calls
    assert not [m for m in calls if m.startswith("Nope")]

def test_clients_need_a_known_api_key(stack):
    for key in ("", "wrong-key", "Bearer"):
        with Client(stack.router.address, api_key=key) as c:
            start = time.perf_counter()
            with pytest.raises(errors.Unauthenticated, match="UNAUTHENTICATED"):
                c.generate(PROMPT, max_tokens=2)
            with pytest.raises(errors.Unauthenticated):
                list(c.stream(PROMPT, max_tokens=2))
            with pytest.raises(errors.Unauthenticated):
                c.status()
            assert time.perf_counter() - start < 2.0
    with Client(stack.router.address, api_key=API_KEY) as c:
        assert len(c.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2
        assert len(c.status().workers) == 2
    with Client(stack.router.address) as c:  # the key from PDSERVE_API_KEY
        assert len(c.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2
    # Read from a file, as the services read theirs (stripped): the same key, not INTERNAL 'Invalid metadata'.
    with Client(stack.router.address, api_key=f" {API_KEY}\n") as c:
        assert len(c.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2
        assert len(list(c.stream(PROMPT, max_tokens=2, ignore_eos=True))) == 2


class FakeDecode(grpc.ServerInterceptor):
    """The named fake of the attack: a gRPC server that says SERVING and counts every other call
    (and keeps every call's method and authorization, health checks included)."""

    def __init__(self):
        self.calls: list[str] = []
        self.seen: list[tuple[str, str]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[self])
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
        self.server.add_generic_rpc_handlers([self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def intercept_service(self, continuation, details):
        self.seen.append((details.method, dict(details.invocation_metadata).get("authorization", "")))
        return continuation(details)

    def service(self, details):  # grpc.GenericRpcHandler: every call that is not health lands here
        self.calls.append(details.method)
        return None  # UNIMPLEMENTED

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def register_fake(s: Stack, fake: FakeDecode, token: str | None) -> str:
    """Write a decode registration for `fake` into Redis, copied from the real decode's (profile
    included) with a load that makes it the router's first choice; signed with `token` if given."""
    r, keys = redis.Redis.from_url(s.redis_url, decode_responses=True), RedisKeys(s.key_prefix)
    real = next(w for w in r.zrange(keys.workers(), 0, -1) if r.hget(keys.worker(w), "role") == "decode")
    record = r.hgetall(keys.worker(real))
    load = {**json.loads(record["load"]), "free_kv_blocks": 1 << 30, "running_requests": 0}
    wid = f"decode-fake-{uuid.uuid4().hex[:6]}"
    record.update(address=fake.address, load=json.dumps(load), heartbeat=str(time.time()))
    record.pop("sig", None)
    if token is not None:
        record["sig"] = sign(token, wid, record)
    r.hset(keys.worker(wid), mapping=record)
    r.expire(keys.worker(wid), 60)
    r.zadd(keys.workers(), {wid: time.time()})
    return wid


def unregister(s: Stack, wid: str) -> None:
    r, keys = redis.Redis.from_url(s.redis_url), RedisKeys(s.key_prefix)
    r.delete(keys.worker(wid))
    r.zrem(keys.workers(), wid)


def router_view(s: Stack, address: str, timeout_s: float = 5.0):
    deadline = time.time() + timeout_s
    with Client(s.router.address) as c:
        while time.time() < deadline:
            seen = [w for w in c.status().workers if w.address == address]
            if seen:
                return seen[0]
            time.sleep(0.1)
    raise AssertionError(f"the router never listed {address}")


@pytest.mark.parametrize("token, reason", [(None, "not signed"), ("a-wrong-token", "signature is wrong")])
def test_a_fake_decode_in_redis_gets_no_prompts(stack, tiny, token, reason):
    fake = FakeDecode()
    wid = register_fake(stack, fake, token)
    try:
        view = router_view(stack, fake.address)
        assert reason in view.refused_reason and not view.healthy
        want = tiny_greedy(tiny, PROMPT, 4)
        with Client(stack.router.address) as c:
            for _ in range(4):
                result = c.generate(PROMPT, max_tokens=4, ignore_eos=True)
                assert result.token_ids == want and result.route["decode"] == stack.decodes[0].address
        assert fake.calls == []
    finally:
        unregister(stack, wid)
        fake.server.stop(0)


def test_a_registration_signed_with_the_deployment_token_is_trusted(stack):
    """The control: the signature is what the router checks, so the same fake signed with the
    right token is chosen (its calls arrive, and fail, since it is a fake)."""
    from tests.support.credentials import SERVICE_TOKEN

    fake = FakeDecode()
    wid = register_fake(stack, fake, SERVICE_TOKEN)
    try:
        deadline = time.time() + 5
        while not router_view(stack, fake.address).healthy:
            assert time.time() < deadline, "the signed fake never became usable"
            time.sleep(0.1)
        with Client(stack.router.address) as c, pytest.raises(errors.PdserveError):
            c.generate(PROMPT, max_tokens=2)
        assert "/pdserve.v1.Decode/Generate" in fake.calls
    finally:
        unregister(stack, wid)
        fake.server.stop(0)


def test_a_workers_load_edited_in_redis_is_not_believed(shared_redis_url, key_prefix):
    """Someone who can write to Redis but lacks the token raises a live worker's free KV blocks, to
    steer traffic to it: the router that knew the worker keeps its signed load; one that did not
    refuses the record."""
    worker = FakeDecode()

    async def scenario(r, keys, reg, pool, other) -> None:
        await reg.beat()
        await pool.refresh()
        assert pool.workers[reg.worker_id].load == {"free_kv_blocks": 10}
        r.hset(keys.worker(reg.worker_id), "load", json.dumps({"free_kv_blocks": 1 << 30}))
        await pool.refresh()
        await other.refresh()
        assert pool.workers[reg.worker_id].load == {"free_kv_blocks": 10}
        assert "signature is wrong" in other.workers[reg.worker_id].refused_reason and other.usable("decode") == []

    _with_a_live_worker(shared_redis_url, key_prefix, worker, scenario)


def test_a_record_written_back_after_its_heartbeat_lapsed_gets_no_call(shared_redis_url, key_prefix, monkeypatch):
    """A worker registers and leaves; an impostor listens on its old address; its record, captured
    while it lived, is written back once its heartbeat lapsed: refused, and not even health-checked
    (a check would carry the deployment's service token to the impostor). A heartbeat from the
    future is refused too."""
    from pdserve.cluster import registry
    from tests.support.credentials import SERVICE_TOKEN

    monkeypatch.setattr(registry, "CLOCK_SKEW_S", 0.2)  # (so the test waits 1.2 s, not 3)
    impostor = FakeDecode()  # (the worker's address, later)

    async def scenario(r, keys, reg, pool, _other) -> None:
        await reg.beat()
        captured = r.hgetall(keys.worker(reg.worker_id))
        await pool.refresh()
        assert [w.worker_id for w in pool.usable("decode")] == [reg.worker_id]  # (the control: trusted)
        await reg.stop()
        await pool.refresh()
        assert pool.workers == {}
        await asyncio.sleep(float(captured["heartbeat"]) + reg.ttl_ms / 1000 + 0.3 - time.time())
        impostor.seen.clear()
        r.delete(keys.worker(reg.worker_id))
        r.hset(keys.worker(reg.worker_id), mapping=captured)
        r.zadd(keys.workers(), {reg.worker_id: time.time()})
        for _ in range(3):
            await pool.refresh()
        assert impostor.seen == [] and pool.usable("decode") == []
        view = pool.workers[reg.worker_id]
        assert "heartbeat is past its TTL" in view.refused_reason and view.channel is None

    _with_a_live_worker(shared_redis_url, key_prefix, impostor, scenario)
    future = {"role": "decode", "address": "127.0.0.1:1", "heartbeat": str(time.time() + 10), "ttl_ms": "1000"}
    future["sig"] = sign(SERVICE_TOKEN, "w", future)
    assert "in the future" in registry.signature_problem(SERVICE_TOKEN, "w", future)


def _with_a_live_worker(url: str, key_prefix: str, fake: FakeDecode, scenario) -> None:
    """Runs `scenario(r, keys, reg, pool, other)`: a decode Registration at `fake`'s address signed
    with the service token, and two routers' worker pools (`other` not refreshed yet)."""
    from pdserve.cluster import connect
    from pdserve.cluster.registry import Registration
    from services.router.workers import WorkerPool
    from tests.support.credentials import SERVICE_TOKEN
    from tests.test_registry import PROFILE

    keys, r = RedisKeys(key_prefix), redis.Redis.from_url(url, decode_responses=True)

    async def run() -> None:
        reg = Registration(url, keys, f"decode-{fake.address}", "decode", fake.address, PROFILE,
                           lambda: {"free_kv_blocks": 10}, interval_s=0.25, service_token=SERVICE_TOKEN)
        pools = [WorkerPool(connect(url, 1.0), keys, PROFILE, 0.25, SERVICE_TOKEN) for _ in range(2)]
        try:
            await scenario(r, keys, reg, *pools)
        finally:
            await reg.stop()
            for pool in pools:
                await pool.stop()
                await pool.redis.aclose()

    try:
        asyncio.run(run())
    finally:
        fake.server.stop(0)
        for key in r.scan_iter(f"{key_prefix}:*"):
            r.delete(key)


def tiny_greedy(tiny, prompt, n):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    return LLMEngine(tiny, EngineConfig(num_blocks=64)).generate(
        [prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def test_a_service_without_a_service_token_refuses_to_start_and_insecure_is_explicit(shared_redis_url, key_prefix):
    from tests.kvstore_support import FINGERPRINT_FLAG, LAYOUT_FLAG
    from tests.support.procs import ServiceProcess

    flags = ("--kv-layout", LAYOUT_FLAG, "--model-fingerprint", FINGERPRINT_FLAG,
             "--device-bytes", str(1 << 20), "--dram-bytes", str(1 << 20), "--redis-url", shared_redis_url,
             "--key-prefix", key_prefix, "--grace-s", "1")
    bare = ServiceProcess("services.kvstore", *flags, env={"PDSERVE_SERVICE_TOKEN": ""}).spawn()
    try:
        assert bare.proc.wait(60) == 1
        assert "no service token: set PDSERVE_SERVICE_TOKEN or --service-token-file" in bare.log()
    finally:
        bare.stop()
    open_store = ServiceProcess("services.kvstore", *flags, "--insecure", env={"PDSERVE_SERVICE_TOKEN": ""}).start()
    try:
        assert "running with --insecure: no credential is checked on any call" in open_store.log()
        with grpc.insecure_channel(open_store.address) as ch:
            stats = kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=5)
        assert stats.active_leases == 0
    finally:
        open_store.stop()


def test_credentials_compare_every_key_and_never_print_a_secret():
    from pdserve.runtime.auth import Caller, Credentials, SecurityConfig, redact_url
    from pdserve.runtime.auth import bearer as bearer_of

    creds = Credentials("svc-token", ("key-a", "key-b"))
    assert [creds.caller(t) for t in ("svc-token", "key-b", "key-", "")] == [Caller.SERVICE, Caller.CLIENT, None, None]
    assert "svc-token" not in repr(creds) and "key-a" not in repr(creds)
    assert bearer_of((("authorization", "Bearer  abc "),)) == "abc" and bearer_of((("authorization", "abc"),)) == ""
    assert redact_url("redis://:pw@h:6380/0") == "redis://:***@h:6380/0"
    assert redact_url("rediss://user:pw@h/1") == "rediss://user:***@h/1"
    loaded = Credentials.load(SecurityConfig(), {"PDSERVE_SERVICE_TOKEN": " t ", "PDSERVE_API_KEYS": "a, b,,"})
    assert (loaded.service_token, loaded.api_keys) == ("t", ("a", "b"))
    with pytest.raises(ValueError, match="go together"):
        SecurityConfig(tls_cert="c.pem")
