"""A pdserve stack of real processes for tests: store, prefill and decode workers (router later)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.runtime.launch import ServiceProcess
from pdserve.runtime.server import channel as internal_channel
from pdserve.v1 import common_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, prefill_pb2, prefill_pb2_grpc

MIB = 1024 * 1024


@dataclass
class Stack:
    redis_url: str
    key_prefix: str
    store: ServiceProcess | None = None
    prefills: list[ServiceProcess] = field(default_factory=list)
    decodes: list[ServiceProcess] = field(default_factory=list)
    router: ServiceProcess | None = None
    env: dict | None = None  # extra environment for every process
    model: str = "tiny"  # (or a checkpoint directory)

    def common(self) -> list[str]:
        """Flags every process gets ('' redis_url: PDSERVE_REDIS_URL in `env` says where Redis is)."""
        redis = ["--redis-url", self.redis_url] if self.redis_url else []
        return [*redis, "--key-prefix", self.key_prefix, "--grace-s", "1"]

    def start_store(self, lease_ms: int = 3000, device_mib: int = 64, dram_mib: int = 128) -> ServiceProcess:
        self.store = ServiceProcess("services.kvstore", "--model", self.model,
                                    "--device-bytes", str(device_mib * MIB), "--dram-bytes", str(dram_mib * MIB),
                                    "--lease-ms", str(lease_ms), *self.common(), env=self.env).start()
        return self.store

    def worker(self, role: str, *flags: str) -> ServiceProcess:
        return ServiceProcess(f"services.{role}", "--model", self.model, "--store", self.store.address,
                              "--heartbeat-s", "0.5", "--threads", "1", "--lease-ms", "2000", "--tail-ttl-ms", "3000",
                              *self.common(), *flags,
                              env=self.env)

    def start(self, num_prefill: int = 1, num_decode: int = 1, prefill_flags=(), decode_flags=()) -> Stack:
        self.start_store()
        procs = [self.worker("prefill", *prefill_flags).spawn() for _ in range(num_prefill)]
        procs += [self.worker("decode", *decode_flags).spawn() for _ in range(num_decode)]
        for p in procs:
            p.wait_ready()
        self.prefills, self.decodes = procs[:num_prefill], procs[num_prefill:]
        return self

    def start_router(self, *flags: str, env: dict | None = None) -> ServiceProcess:
        self.router = ServiceProcess("services.router", "--model", self.model, "--store", self.store.address,
                                     "--refresh-s", "0.2", *self.common(), *flags, env=env).start()
        return self.router

    def wait_pool(self, healthy: int, timeout_s: float = 20.0) -> None:
        import time

        from pdserve.client import Client

        with Client(self.router.address) as c:
            deadline = time.time() + timeout_s
            while True:
                workers = list(c.status().workers)
                if sum(1 for w in workers if w.healthy) == healthy:
                    break
                assert time.time() < deadline, (f"pool did not reach {healthy} healthy workers: "
                                                f"{[(w.address, w.healthy, w.refused_reason) for w in workers]}")
                time.sleep(0.1)

    def stop(self) -> None:
        for p in [*([self.router] if self.router else []), *self.prefills, *self.decodes,
                  *([self.store] if self.store else [])]:
            p.stop()


def routed_stack(redis_url: str, num_prefill: int, num_decode: int) -> Stack:
    """A whole stack behind a router, its pool healthy, under a key prefix of its own."""
    import uuid

    s = Stack(redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(num_prefill=num_prefill, num_decode=num_decode)
    s.start_router()
    s.wait_pool(num_prefill + num_decode)
    return s


def stubs(address: str, kind: str):
    channel = internal_channel(address)  # (carries the session's service token)
    cls = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub,
           "kvstore": kvstore_pb2_grpc.KVStoreStub}[kind]
    return channel, cls(channel)


async def prefill_whole(stub: prefill_pb2_grpc.PrefillStub, request: prefill_pb2.PrefillRequest,
                        timeout: float) -> prefill_pb2.PrefillResponse:
    """One Prefill call read to its end: its first message (the first token), once the second
    says the handoff is complete (every block committed)."""
    first, done = [e async for e in stub.Prefill(request, timeout=timeout)]
    assert first.HasField("first") and done.HasField("done"), (first, done)
    return first.first


async def load(address: str, kind: str) -> common_pb2.WorkerLoad:
    ch, stub = stubs(address, kind)
    async with ch:
        return await stub.Load(prefill_pb2.LoadRequest(), timeout=5)


async def store_stats(address: str) -> kvstore_pb2.StatsResponse:
    ch, stub = stubs(address, "kvstore")
    async with ch:
        return await stub.Stats(kvstore_pb2.StatsRequest(), timeout=5)


SETTLED = ((0, 0, 0, 0), (True, True), (0, 0, [0, 0]))  # what `settled` returns when nothing is held


async def settled(stack: Stack, timeout_s: float = 10.0):
    """The leak audit of a 1 P + 1 D stack: requests, pages, leases, watchers and pins, polled
    until nothing is held (handoff tails wait out their TTL) or `timeout_s` passes."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        p = await load(stack.prefills[0].address, "prefill")
        d = await load(stack.decodes[0].address, "decode")
        st = await store_stats(stack.store.address)
        state = ((p.running_requests, p.inflight_requests, d.running_requests, d.inflight_requests),
                 (p.free_kv_blocks == p.total_kv_blocks, d.free_kv_blocks == d.total_kv_blocks),
                 (st.active_leases, st.watchers, [t.pinned_blocks for t in st.tiers]))
        if state == SETTLED or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


def run(coro):
    return asyncio.run(coro)
