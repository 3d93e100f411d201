"""Transport faults and exposure: a hung (SIGSTOPped) peer is detected by keepalive in seconds,
not at the call's deadline; what a service listens on; Redis with a password end to end."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

from pdserve.client import Client
from pdserve.runtime.server import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, channel
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, prefill_pb2
from tests.kvstore_support import start_store
from tests.support.procs import RedisServer, listening
from tests.support.stack import Stack, prefill_whole, run, store_stats, stubs


def test_a_stopped_store_fails_calls_at_the_keepalive_bound_not_the_deadline(shared_redis_url, key_prefix):
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)

    async def stalled_call() -> tuple[str, float]:
        async with channel(store.address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            await stub.Stats(kvstore_pb2.StatsRequest(), timeout=5)  # the connection is up
            store.signal(signal.SIGSTOP)
            start = time.perf_counter()
            try:
                await stub.Stats(kvstore_pb2.StatsRequest(), timeout=60)
            except Exception as e:  # noqa: BLE001 - the status is what the test checks
                return e.code().name, time.perf_counter() - start
            return "OK", time.perf_counter() - start

    try:
        code, took = asyncio.run(stalled_call())
    finally:
        store.signal(signal.SIGCONT)
        store.stop()
    bound = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
    assert code == "UNAVAILABLE" and took < bound + 2.0, (code, took)


def test_every_port_listens_on_the_configured_host_the_transfer_engine_s_too(shared_redis_url, key_prefix):
    """The Mooncake Transfer Engine (0.3.13) binds its handshake port (INADDR_ANY) and its data
    port (IPv6 any, dual stack) to every address on its own; the bind interposer
    (runtime.bind_host) puts both on --te-host. A store started without it (LD_PRELOAD emptied, as
    when run by hand) re-executes itself with it, keeping its pid; a worker started by the launcher
    has it from the start. The store's transfers to the worker work over the confined ports."""
    s = Stack(shared_redis_url, key_prefix, env={"LD_PRELOAD": ""})
    try:
        store = s.start_store()
        s.env = None
        prefill = s.worker("prefill").start()
        info = asyncio.run(_info(store.address))
        te_rpc_port = int(info.segment.rsplit(":", 1)[1])
        for proc, reexecuted in ((store, True), (prefill, False)):
            socks = listening(proc.proc.pid)
            assert {a for a, _ in socks} == {"127.0.0.1"} and len(socks) >= 3, socks  # gRPC, TE rpc, TE data
            assert proc.port in {p for _, p in socks}
            with open(f"/proc/{proc.proc.pid}/environ", "rb") as f:
                assert (b"PDSERVE_BIND_REEXEC=1" in f.read().split(b"\0")) == reexecuted
        assert ("127.0.0.1", te_rpc_port) in listening(store.proc.pid)
        reply = run(_prefill(prefill.address, [5] * 40))  # its KV written into the store, read back
        assert len(reply.block_hashes) == 2 and reply.usage.prompt_tokens == 40, reply
        stats = run(store_stats(store.address))
        assert sum(t.used_blocks for t in stats.tiers) >= 2, stats
    finally:
        s.stop()


async def _prefill(address: str, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    ch, stub = stubs(address, "prefill")
    async with ch:
        return await prefill_whole(stub, prefill_pb2.PrefillRequest(
            request_id="bind-1", prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)), timeout=30)


async def _info(address: str) -> kvstore_pb2.InfoResponse:
    async with channel(address) as ch:
        return await kvstore_pb2_grpc.KVStoreStub(ch).Info(kvstore_pb2.InfoRequest(), timeout=5)


def test_redis_with_a_password_end_to_end_and_the_password_is_never_shown():
    password = uuid.uuid4().hex
    server = RedisServer(password=password).start()
    env = {"PDSERVE_REDIS_URL": server.url}  # by environment: a flag would show it in `ps`
    s = Stack("", f"pdtest-pw-{uuid.uuid4().hex[:8]}", env=env)
    try:
        s.start(num_prefill=1, num_decode=1)
        s.start_router(env=env)
        s.wait_pool(2)
        with Client(s.router.address) as c:
            assert len(c.generate([5] * 40, max_tokens=3, ignore_eos=True).token_ids) == 3
            assert c.status().redis_connected
        for p in (s.store, *s.prefills, *s.decodes, s.router):
            with open(f"/proc/{p.proc.pid}/cmdline", "rb") as f:
                assert password.encode() not in f.read()
            assert password not in p.log()
    finally:
        s.stop()
        server.stop()
