"""Transport faults and exposure: a hung (SIGSTOPped) peer is detected by keepalive in seconds,
not at the call's deadline; what a service listens on; Redis with a password end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

from pdserve.client import Client
from pdserve.runtime.server import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, channel
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.kvstore_support import start_store
from tests.support.procs import RedisServer
from tests.support.stack import Stack


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


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket the process listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    found.add((_address(addr, width), int(port, 16)))
    return found


def _address(hexaddr: str, width: int) -> str:
    """/proc/net/tcp{,6}'s hex address as text; an IPv4-mapped IPv6 one as its IPv4 address."""
    if width == 32 and hexaddr.startswith("0000000000000000FFFF0000"):
        hexaddr, width = hexaddr[24:], 8
    if width == 8:
        return ".".join(str(b) for b in reversed(bytes.fromhex(hexaddr)))
    return "::" if set(hexaddr) == {"0"} else hexaddr


def test_the_grpc_port_listens_on_the_configured_host_and_only_the_transfer_engine_does_not(
        shared_redis_url, key_prefix):
    """The Mooncake Transfer Engine (0.3.13) binds its handshake port (findAvailableTcpPort:
    INADDR_ANY) and its TCP data port (asio tcp::v6() any, dual stack) to every address; nothing
    in its API or environment changes that (MC_TCP_BIND_ADDRESS only names the address it
    advertises in non-P2P mode). This pins down exactly that, so the day it can be bound the test
    says so: everything else listens on --host."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        socks = listening(store.proc.pid)
        info = asyncio.run(_info(store.address))
        te_rpc_port = int(info.segment.rsplit(":", 1)[1])
        assert ("127.0.0.1", store.port) in socks
        wildcard = {(a, p) for a, p in socks if a in ("0.0.0.0", "::")}
        assert ("0.0.0.0", te_rpc_port) in wildcard and len(wildcard) == 2, socks
        assert all(a in ("127.0.0.1", "0.0.0.0", "::") for a, _ in socks), socks
    finally:
        store.stop()


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
