"""How store clients reach the store: gRPC only, over the store's abstract Unix address where
the client's host reaches it and TCP otherwise; a dead, restarted or paused store, with the real
transfer engine and real Redis, the store in its own process."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import torch

from pdserve.kvclient import store_client
from pdserve.kvclient.store_client import StoreClient
from pdserve.runtime.launch import free_port
from tests.kv_peer import block_data, block_hash
from tests.kvstore_support import LocalClient, start_store, tier_stats


def test_calls_fail_unavailable_when_the_store_dies(shared_redis_url, key_prefix):
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        c = LocalClient(store.address)

        async def scenario(client: StoreClient):
            first = await client.pin([block_hash(9, 0)])
            assert first.lease_id == ""  # nothing stored: nothing pinned
            store.proc.send_signal(signal.SIGKILL)
            store.proc.wait()
            for _ in range(2):  # on the broken Unix connection (then TCP, asked again), then on a dead address
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.pin([block_hash(9, 0)])
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        c.call(scenario)
    finally:
        store.stop()


# The tests below store their blocks through the gRPC-bytes path, not this process's
# transfer engine. Mooncake caches a peer's segment by its name, "host:rpc_port", for the life of
# the process; a new store that happens to get a dead store's port is unreachable from an engine
# that talked to the dead one (its cached descriptor names the dead transport). A test process
# talks to many stores: fewer transfer-engine peers, fewer such collisions.


def test_a_client_finds_a_restarted_store_at_its_new_unix_address(shared_redis_url, key_prefix):
    """The store restarts on the same TCP address, its Unix address (and transfer-engine segment)
    elsewhere: the client's next call fails on the old Unix address, asks again where the store
    is, and is served by the new store."""
    port = free_port()
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4, extra=("--port", str(port)))
    try:
        c = LocalClient(store.address)

        async def scenario(client: StoreClient):
            nonlocal store
            assert (await client.pin([block_hash(9, 0)])).lease_id == ""
            first_address, first_segment = client.address_used, client.segment
            store.stop()
            store = start_store(shared_redis_url, key_prefix + "b", device_blocks=4, dram_blocks=4,
                                extra=("--port", str(port)))
            await asyncio.sleep(0.2)  # the old connection's end reaches the client
            assert (await client.pin([block_hash(9, 0)])).lease_id == ""
            assert first_address.startswith("unix-abstract:pdserve-kvstore-")  # (the same host)
            assert client.address_used != first_address and client.segment != first_segment

        c.call(scenario)
    finally:
        store.stop()


def test_a_client_uses_the_stores_unix_address_where_it_reaches_it_and_tcp_otherwise(shared_redis_url, key_prefix,
                                                                                       monkeypatch):
    """On the store's host the client's calls go to the store's abstract Unix address. A store
    started with --unix false offers none, and an address the client cannot reach (another
    host's or container's) leaves it on TCP: each way, the same calls are served."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    tcp_only = start_store(shared_redis_url, key_prefix + "t", device_blocks=4, dram_blocks=4,
                           extra=("--unix", "false"))
    try:
        async def served(client: StoreClient) -> str:
            assert (await client.pin([block_hash(9, 0)])).lease_id == ""
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.release("0" * 32)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            return client.address_used

        info = LocalClient(store.address).call(StoreClient.connect)
        assert info.unix_address.startswith("unix-abstract:pdserve-kvstore-") and len(info.unix_address) == 62
        assert LocalClient(store.address).call(served) == info.unix_address
        tcp_info = LocalClient(tcp_only.address).call(StoreClient.connect)
        assert tcp_info.unix_address == ""
        assert LocalClient(tcp_only.address).call(served) == tcp_only.address

        real = store_client.channel

        def elsewhere(target: str):  # the store's answer names a Unix address this host has not
            return real("unix-abstract:pdserve-kvstore-" + "0" * 32 if target.startswith("unix") else target)

        monkeypatch.setattr(store_client, "channel", elsewhere)
        assert LocalClient(store.address).call(served) == store.address
    finally:
        store.stop()
        tcp_only.stop()


def test_a_call_the_store_does_not_answer_in_time_fails_deadline_exceeded(shared_redis_url, key_prefix):
    """The store stops answering (its process paused): the call fails DEADLINE_EXCEEDED at its
    deadline; once it resumes, the same client is served again."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        c = LocalClient(store.address)
        c.call(StoreClient.put_bytes, [block_hash(3, 0)], bytes(block_data(3, 0).numpy()))  # no transfer: see above

        async def scenario(client: StoreClient):
            client.timeout_s = 0.5
            assert len((await client.pin([block_hash(3, 0)])).slots) == 1  # connected, leases 1 (lapses)
            store.proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.pin([block_hash(3, 0)])
                waited = time.monotonic() - t0
            finally:
                store.proc.send_signal(signal.SIGCONT)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0.5 <= waited < 2.0
            client.timeout_s = 5.0
            again = await client.pin([block_hash(3, 0)])
            assert len(again.slots) == 1
            await client.release(again.lease_id)

        c.call(scenario)
        # The pins of the unanswered call and of the first lapse with their 2 s leases.
        deadline = time.monotonic() + 2.0 + 2.0
        while (s := c.stats()).active_leases and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.active_leases == 0 and tier_stats(s)["device"] == {"used": 1, "pinned": 0, "evictions": 0}
    finally:
        store.stop()


def test_a_cancelled_read_returns_only_once_the_engine_is_done_with_the_callers_memory(shared_redis_url, key_prefix):
    """The engine cannot stop a move: a caller cancelled mid-read must not get its memory back
    (to hand on as KV pages) while bytes may still land in it. The store is stopped so the read
    cannot finish; the cancelled call waits until it has."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=256, dram_blocks=4, lease_ms=30_000)
    try:
        c = LocalClient(store.address)
        c.put(40, list(range(256)))  # 8 MiB: more than a stopped peer's socket takes

        async def scenario(client: StoreClient):
            pinned = await client.pin([block_hash(40, i) for i in range(256)])
            assert len(pinned.slots) == 256
            c.buf.tensor.zero_()
            store.proc.send_signal(signal.SIGSTOP)
            try:
                read = asyncio.ensure_future(client.read_slots(pinned.slots, [c.buf.addr(i) for i in range(256)]))
                await asyncio.sleep(0.5)
                read.cancel()
                done, _ = await asyncio.wait([read], timeout=1.5)
                assert not done  # waited out, not handed back
            finally:
                store.proc.send_signal(signal.SIGCONT)
            done, _ = await asyncio.wait([read], timeout=20)
            assert read in done and read.cancelled()
            assert all(torch.equal(c.buf.block(i), block_data(40, i)) for i in range(256))  # landed before it ended
            await client.release(pinned.lease_id)

        c.call(scenario)
        assert c.stats().active_leases == 0
    finally:
        store.stop()


def test_finding_the_store_again_cuts_no_call_short(shared_redis_url, key_prefix):
    """A reconnect (another caller found the store's address failing) replaces the client's
    channels: a call on the old ones runs on to its end. Before, they were closed under it, and
    the call ended in CancelledError (its caller taken for cancelled: no retry, a misleading
    status)."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        c = LocalClient(store.address)
        writer = LocalClient(store.address)

        async def scenario(client: StoreClient):
            batches = []

            async def watch():
                async for batch in client.watch([block_hash(4, 0)], lease_ms=5000, timeout_s=10):
                    batches.append(batch.indices)

            watching = asyncio.ensure_future(watch())
            await asyncio.sleep(0.3)  # the watch is waiting on the store, on the first channels
            await client.connect()
            await asyncio.to_thread(writer.call, StoreClient.put_bytes, [block_hash(4, 0)],
                                    bytes(block_data(4, 0).numpy()))
            await asyncio.wait_for(watching, 5)
            return batches

        assert c.call(scenario) == [[0]]
    finally:
        store.stop()


def test_a_kept_alive_lease_outlives_a_renewal_the_store_missed(shared_redis_url, key_prefix):
    """keep_alive renews a write lease every third of its length; a renewal that fails while the
    store is away for a moment (here paused past the call's deadline) is tried again on the next
    tick. Before, the first failure ended the renewals, and the lease lapsed under its writer."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        c = LocalClient(store.address)

        async def scenario(client: StoreClient):
            client.timeout_s = 0.5
            alloc = await client.allocate([block_hash(5, 0)], lease_ms=1500)
            renewing = client.keep_alive(alloc.lease_id, 1500)  # every 0.5 s
            try:
                await asyncio.sleep(0.2)
                store.proc.send_signal(signal.SIGSTOP)  # the renewal due at 0.5 s fails at its deadline
                await asyncio.sleep(0.9)
                store.proc.send_signal(signal.SIGCONT)
                await asyncio.sleep(3.0)  # two lease lengths: only renewals keep it
                assert not renewing.done()
                await client.renew(alloc.lease_id, 1500)  # still open: FAILED_PRECONDITION if it lapsed
            finally:
                renewing.cancel()
                store.proc.send_signal(signal.SIGCONT)
            await client.release(alloc.lease_id)

        c.call(scenario)
    finally:
        store.stop()
