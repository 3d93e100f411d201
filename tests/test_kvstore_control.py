"""The store's control socket (the control calls as frames on one TCP connection per client),
against the unary gRPC calls, with the real transfer engine and real Redis, the store in its own
process."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import grpc
import pytest

from pdserve.kv.control_channel import ControlAddress, ControlChannel
from pdserve.kv.control_frames import FrameReader, frame
from pdserve.kv.store_client import StoreClient, grpc_host
from pdserve.launch import free_port
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.wire import profile_to_pb
from tests.kv_peer import PROFILE, block_data, block_hash
from tests.kvstore_support import LocalClient, start_store, tier_stats


def test_control_socket_answers_as_the_unary_calls_and_outlives_their_errors(small_store):
    """StoreClient's control calls ride one control connection: each failure comes back with the
    code and message of the unary call, the connection goes on serving, and calls made at once
    from many coroutines each get their own answer."""
    c = LocalClient(small_store.address)
    for i in range(3):
        c.put(7, [i])  # blocks (7, 0..2) stored

    async def scenario(client: StoreClient):
        bad = [block_hash(7, 0), block_hash(7, 0)]
        bad_pb = b"".join(bad)
        unary, stream = [], []
        calls = [
            (lambda: client.stub.AllocatePut(pb.AllocatePutRequest(profile=client.profile_pb, block_hashes=bad_pb)),
             lambda: client.allocate(bad)),
            (lambda: client.stub.CommitPut(pb.CommitPutRequest(lease_id="w999")), lambda: client.commit("w999")),
            (lambda: client.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="r999")),
             lambda: client.release("r999")),
            (lambda: client.stub.RenewLease(pb.RenewLeaseRequest(lease_id="r999")), lambda: client.renew("r999")),
        ]
        for via_unary, via_stream in calls:
            for fn, out in ((via_unary, unary), (via_stream, stream)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await fn()
                out.append((err.value.code(), err.value.details()))
        assert stream == unary
        assert [code for code, _ in stream] == [grpc.StatusCode.INVALID_ARGUMENT, *[grpc.StatusCode.NOT_FOUND] * 3]

        # The connection still serves, and 30 calls in flight at once each get their own answer.
        chains = [[block_hash(7, i) for i in range(k % 3 + 1)] + [block_hash(8, k)] for k in range(30)]
        pins = await asyncio.gather(*(client.pin(chain) for chain in chains))
        assert [len(p.slots) for p in pins] == [k % 3 + 1 for k in range(30)]
        assert len({p.lease_id for p in pins}) == 30
        released = await asyncio.gather(*(client.release(p.lease_id) for p in pins))
        assert [r.unpinned for r in released] == [k % 3 + 1 for k in range(30)]
        # A call cancelled in flight leaves nothing waiting on the connection (its pin, if the
        # store made it, lapses with its lease).
        task = asyncio.ensure_future(client.pin(chains[0]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await client.pin([block_hash(8, 0)])).lease_id == ""
        assert client._control._conn.pending == {}

    c.call(scenario)
    deadline = time.monotonic() + 1.0 + 2.0  # lease + 2 s
    while (s := c.stats()).active_leases and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s.active_leases == 0 and tier_stats(s)["device"]["pinned"] == 0


def test_control_calls_fail_unavailable_when_the_store_dies(shared_redis_url, key_prefix):
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        c = LocalClient(store.address)

        async def scenario(client: StoreClient):
            first = await client.pin([block_hash(9, 0)])
            assert first.lease_id == ""  # nothing stored: nothing pinned
            store.proc.send_signal(signal.SIGKILL)
            store.proc.wait()
            for _ in range(2):  # on the broken connection, then on a new one to a dead address
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


def _raw_connection(store) -> tuple[socket.socket, int]:
    info = LocalClient(store.address).call(StoreClient.connect)
    return socket.create_connection((grpc_host(store.address), info.control_port), timeout=10), info.control_port


def _answers(sock: socket.socket, count: int) -> list[pb.ControlResponse]:
    reader, out = FrameReader(), []
    while len(out) < count:
        data = sock.recv(65536)
        assert data, "the store closed the connection"
        out += [pb.ControlResponse.FromString(p) for p in reader.feed(data)]
    return out


def test_unreadable_frames_end_only_their_connection(small_store):
    """A frame naming no call is refused on its own and the connection goes on; a frame over the
    size limit, or one that is not a ControlRequest, has no call id to answer: the store ends
    that connection and goes on serving every other."""
    sock, _ = _raw_connection(small_store)
    sock.sendall(frame(pb.ControlRequest(call_id=41))
                 + frame(pb.ControlRequest(call_id=42, release_lease=pb.ReleaseLeaseRequest(lease_id="r999"))))
    first, second = _answers(sock, 2)
    assert (first.call_id, first.status_code) == (41, grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert first.status_message == "control: the message names no call"
    assert (second.call_id, second.status_code) == (42, grpc.StatusCode.NOT_FOUND.value[0])
    assert second.status_message == "lease 'r999' is unknown or lapsed"

    oversized = (1 << 31).to_bytes(4, "little")
    garbage = len(b"\xff\xff\xff").to_bytes(4, "little") + b"\xff\xff\xff"
    for bad in (oversized, garbage):
        other, _ = _raw_connection(small_store)
        other.sendall(bad)
        assert other.recv(65536) == b""  # closed by the store, nothing answered
        other.close()
    # The first connection and new clients are served as before.
    sock.sendall(frame(pb.ControlRequest(call_id=43, release_lease=pb.ReleaseLeaseRequest(lease_id="r998"))))
    [third] = _answers(sock, 1)
    assert (third.call_id, third.status_code) == (43, grpc.StatusCode.NOT_FOUND.value[0])
    sock.close()
    c = LocalClient(small_store.address)
    c.call(StoreClient.put_bytes, [block_hash(5, 0)], bytes(block_data(5, 0).numpy()))  # no transfer: see above
    s = c.stats()
    assert s.active_leases == 0 and tier_stats(s)["device"] == {"used": 1, "pinned": 0, "evictions": 0}


def test_a_commits_bookkeeping_is_done_before_the_next_frame_is_served(small_store):
    """A commit is answered first and its bookkeeping (committed, in the eviction order, in the
    index) runs after, but before the store serves the connection's next frame, even one that
    came in the same read: a get and an allocate sent with the commit find the blocks stored."""
    sock, _ = _raw_connection(small_store)
    profile, hashes = profile_to_pb(PROFILE), b"".join(block_hash(9, i) for i in range(3))
    sock.sendall(frame(pb.ControlRequest(call_id=1, allocate_put=pb.AllocatePutRequest(
        profile=profile, block_hashes=hashes))))
    [alloc] = _answers(sock, 1)
    assert alloc.allocate_put.slots.states == bytes([pb.SLOT_STATE_WRITE]) * 3
    sock.sendall(frame(pb.ControlRequest(call_id=2, commit_put=pb.CommitPutRequest(
                     lease_id=alloc.allocate_put.lease_id)))
                 + frame(pb.ControlRequest(call_id=3, get=pb.GetRequest(profile=profile, block_hashes=hashes)))
                 + frame(pb.ControlRequest(call_id=4, allocate_put=pb.AllocatePutRequest(
                     profile=profile, block_hashes=hashes))))
    commit, got, again = _answers(sock, 3)
    assert (commit.commit_put.committed, commit.commit_put.lease_closed) == (3, True)
    assert got.get.slots.states == bytes([pb.SLOT_STATE_PRESENT]) * 3
    assert got.get.slots.addresses == alloc.allocate_put.slots.addresses
    assert again.allocate_put.slots.states == bytes([pb.SLOT_STATE_PRESENT]) * 3
    sock.sendall(frame(pb.ControlRequest(call_id=5, release_lease=pb.ReleaseLeaseRequest(
        lease_id=got.get.lease_id))))
    [released] = _answers(sock, 1)
    assert (released.release_lease.unpinned, released.release_lease.reclaimed) == (3, 0)
    sock.close()
    s = LocalClient(small_store.address).stats()
    assert s.active_leases == 0 and tier_stats(s)["device"] == {"used": 3, "pinned": 0, "evictions": 0}


def test_a_client_finds_a_restarted_store_at_its_new_control_port(shared_redis_url, key_prefix):
    """The store restarts on the same gRPC address, its control socket (and transfer-engine
    segment) elsewhere: the client's next call, after the old connection broke, asks again where
    they are and is served by the new store."""
    port = free_port()
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4, extra=("--port", str(port)))
    try:
        c = LocalClient(store.address)

        async def scenario(client: StoreClient):
            nonlocal store
            assert (await client.pin([block_hash(9, 0)])).lease_id == ""
            first_address, first_segment = client._control._conn.address, client.segment
            store.stop()
            store = start_store(shared_redis_url, key_prefix + "b", device_blocks=4, dram_blocks=4,
                                extra=("--port", str(port)))
            await asyncio.sleep(0.2)  # the old connection's end reaches the client
            assert (await client.pin([block_hash(9, 0)])).lease_id == ""
            assert first_address.startswith("unix:@pdserve-kvstore-")  # (the same host)
            assert client._control._conn.address != first_address and client.segment != first_segment

        c.call(scenario)
    finally:
        store.stop()


def test_a_client_uses_the_stores_unix_socket_where_it_reaches_it_and_tcp_otherwise(shared_redis_url, key_prefix):
    """On the store's host the control connection is the store's abstract Unix socket. A store
    started with --control-unix false offers none, and a name the client cannot reach (another
    host's or container's) leaves it TCP: each way, the same calls are served."""
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    tcp_only = start_store(shared_redis_url, key_prefix + "t", device_blocks=4, dram_blocks=4,
                           extra=("--control-unix", "false"))
    try:
        async def served(client: StoreClient) -> str:
            assert (await client.pin([block_hash(9, 0)])).lease_id == ""
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.release("r999")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            return client._control._conn.address

        info = LocalClient(store.address).call(StoreClient.connect)
        assert info.control_unix_name.startswith("pdserve-kvstore-") and len(info.control_unix_name) == 48
        assert LocalClient(store.address).call(served) == f"unix:@{info.control_unix_name}"
        tcp_info = LocalClient(tcp_only.address).call(StoreClient.connect)
        assert tcp_info.control_unix_name == ""
        assert LocalClient(tcp_only.address).call(served) == f"127.0.0.1:{tcp_info.control_port}"

        async def unreachable(client: StoreClient) -> str:
            async def elsewhere() -> ControlAddress:
                return ControlAddress("127.0.0.1", info.control_port, "pdserve-kvstore-" + "0" * 32)
            client._control = ControlChannel(elsewhere)
            return await served(client)

        assert LocalClient(store.address).call(unreachable) == f"127.0.0.1:{info.control_port}"
    finally:
        store.stop()
        tcp_only.stop()


def test_a_call_the_store_does_not_answer_in_time_fails_deadline_exceeded(shared_redis_url, key_prefix):
    """The store stops answering (its process paused): the call fails DEADLINE_EXCEEDED at its
    deadline with nothing left waiting; the store's late answer, once it resumes, is dropped and
    the connection serves the next call."""
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
            assert err.value.details() == "get: no answer from the store within 0.5 s"
            assert 0.5 <= waited < 2.0
            assert client._control._conn.pending == {}
            client.timeout_s = 5.0
            again = await client.pin([block_hash(3, 0)])  # the late answer to the first is dropped
            assert len(again.slots) == 1 and not client._control._conn.broken
            await client.release(again.lease_id)

        c.call(scenario)
        # The pins of the unanswered call and of the first lapse with their 2 s leases.
        deadline = time.monotonic() + 2.0 + 2.0
        while (s := c.stats()).active_leases and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.active_leases == 0 and tier_stats(s)["device"] == {"used": 1, "pinned": 0, "evictions": 0}
    finally:
        store.stop()
