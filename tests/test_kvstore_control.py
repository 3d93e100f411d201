"""The store's Control stream (the control calls as messages on one stream per client), over
real gRPC, the real transfer engine and real Redis, the store in its own process."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pdserve.kv.store_client import StoreClient
from pdserve.v1 import kvstore_pb2 as pb
from tests.kv_peer import block_hash
from tests.kvstore_support import LocalClient, start_store, tier_stats


def test_control_stream_answers_as_the_unary_calls_and_outlives_their_errors(small_store):
    """StoreClient's control calls ride one Control stream: each failure comes back with the code
    and message of the unary call, the stream goes on serving, and calls made at once from many
    coroutines each get their own answer."""
    c = LocalClient(small_store.address)
    for i in range(3):
        c.put(7, [i])  # blocks (7, 0..2) stored

    async def scenario(client: StoreClient):
        bad = [block_hash(7, 0), block_hash(7, 0)]
        unary, stream = [], []
        calls = [
            (lambda: client.stub.AllocatePut(pb.AllocatePutRequest(profile=client.profile_pb, block_hashes=bad)),
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

        # The stream still serves, and 30 calls in flight at once each get their own answer.
        chains = [[block_hash(7, i) for i in range(k % 3 + 1)] + [block_hash(8, k)] for k in range(30)]
        pins = await asyncio.gather(*(client.pin(chain) for chain in chains))
        assert [len(p.slots) for p in pins] == [k % 3 + 1 for k in range(30)]
        assert len({p.lease_id for p in pins}) == 30
        released = await asyncio.gather(*(client.release(p.lease_id) for p in pins))
        assert [r.unpinned for r in released] == [k % 3 + 1 for k in range(30)]
        # A call cancelled in flight leaves nothing waiting on the stream (its pin, if the store
        # made it, lapses with its lease).
        task = asyncio.ensure_future(client.pin(chains[0]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await client.pin([block_hash(8, 0)])).lease_id == ""
        assert client._control._stream.pending == {}

        # A message that names no call is refused on its own; the stream goes on.
        call = client.stub.Control()
        await call.write(pb.ControlRequest(call_id=41))
        await call.write(pb.ControlRequest(call_id=42, release_lease=pb.ReleaseLeaseRequest(lease_id="r999")))
        first, second = await call.read(), await call.read()
        assert (first.call_id, first.status_code) == (41, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        assert first.status_message == "Control: the message names no call"
        assert (second.call_id, second.status_code) == (42, grpc.StatusCode.NOT_FOUND.value[0])
        call.cancel()

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
            for _ in range(2):  # on the broken stream, then on a new one to a dead address
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.pin([block_hash(9, 0)])
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        c.call(scenario)
    finally:
        store.stop()
