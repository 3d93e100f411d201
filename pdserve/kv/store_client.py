"""Client of the KV store: control plane over gRPC, bytes over the transfer engine (or gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

import grpc
import numpy as np

from pdserve import logs
from pdserve.kv.control_channel import ControlAddress, ControlChannel, rpc_error
from pdserve.kv.layout import HashProfile
from pdserve.kv.transfer import Span, Transfer, block_spans
from pdserve.server import channel
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc
from pdserve.wire import hashes_to_pb, profile_to_pb

log = logs.get("kv.client")

@dataclass(frozen=True)
class PutResult:
    written: int  # blocks this call wrote
    present: int  # already stored
    pending: int  # another writer is writing them
    slices: int  # transfer-engine slices used


@dataclass(frozen=True)
class GetResult:
    num_blocks: int  # prefix blocks read (the tail not counted)
    has_tail: bool
    slices: int


class SlotInfo(NamedTuple):  # one block's slot, made when `SlotColumns` are indexed or iterated
    address: int
    tier: int  # pb.Tier
    state: int  # pb.SlotState


def grpc_host(target: str) -> str:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port", "ipv4:host:port")."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    if target.startswith("["):
        return target[1 : target.index("]")]
    host, sep, _ = target.rpartition(":")
    if not sep or not host:
        raise ValueError(f"store address {target!r} is not host:port")
    return host


@dataclass(frozen=True, slots=True)
class SlotColumns(Sequence[SlotInfo]):
    """The slots of one answer, kept as the columns they came in: a 1,024-block answer is read
    without a tuple per block (the transfer paths use the columns); indexing or iterating gives
    `SlotInfo`s, slicing gives columns."""

    addresses: np.ndarray  # uint64, read in place from the answer's bytes
    tiers: bytes  # pb.Tier values, one byte each
    states: bytes  # pb.SlotState values, one byte each

    def __len__(self) -> int:
        return len(self.addresses)

    @overload
    def __getitem__(self, i: int) -> SlotInfo: ...

    @overload
    def __getitem__(self, i: slice) -> SlotColumns: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return SlotColumns(self.addresses[i], self.tiers[i], self.states[i])
        return SlotInfo(int(self.addresses[i]), self.tiers[i], self.states[i])

    def __iter__(self) -> Iterator[SlotInfo]:
        return map(SlotInfo, self.addresses.tolist(), self.tiers, self.states)


def slots_from_pb(m: pb.SlotList) -> SlotColumns:
    addresses, tiers, states = m.addresses, m.tiers, m.states  # (each read of a field makes a copy)
    if not len(addresses) == 8 * len(tiers) == 8 * len(states):
        raise ValueError(f"malformed slot list from the store: {len(addresses)} bytes of addresses (8 each), "
                         f"{len(tiers)} tiers, {len(states)} states")
    return SlotColumns(np.frombuffer(addresses, "<u8"), tiers, states)


def slot_from_pb(m: pb.Slot) -> SlotInfo:
    return SlotInfo(m.address, m.tier, m.state)


@dataclass(frozen=True)
class Allocation:
    lease_id: str
    slots: SlotColumns  # one per hash, then the tail's
    hold_lease_id: str = ""  # the store's hold on these blocks for their reader (allocate's hold_ms)


@dataclass(frozen=True)
class WatchBatch:
    lease_id: str
    indices: list[int]  # positions in the watched hashes; len(hashes) for the tail
    slots: SlotColumns


@dataclass(frozen=True)
class Pinned:
    lease_id: str  # empty when nothing was found
    slots: SlotColumns  # the longest stored prefix
    tail: SlotInfo | None


class StoreClient:
    """One store, one profile. Local addresses must lie in memory registered with `transfer`."""

    def __init__(self, target: str, profile: HashProfile, transfer: Transfer | None = None,
                 timeout_s: float = 5.0):
        self.target = target
        self.profile = profile
        self.profile_pb = profile_to_pb(profile)
        self.transfer = transfer
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None  # made on first use, bound to the running loop
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self.segment = ""
        self.block_nbytes = profile.layout.block_nbytes
        self._releasing: set[asyncio.Task] = set()  # release_soon() calls still in flight
        self._control = ControlChannel(self._locate_control)  # allocate, commit, get, renew, release

    async def connect(self) -> pb.InfoResponse:
        info = await self.stub.Info(pb.InfoRequest(), timeout=self.timeout_s)
        self.segment = info.segment
        return info

    async def _locate_control(self) -> ControlAddress:
        """Where the store's control socket is: asked at each (re)connect, as a restarted store
        listens elsewhere (and has a new transfer-engine segment too)."""
        info = await self.connect()
        if not info.control_port:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the store at {self.target} reports no control socket")
        return ControlAddress(grpc_host(self.target), info.control_port, info.control_unix_name)

    @property
    def stub(self) -> kvstore_pb2_grpc.KVStoreStub:
        if self._stub is None:
            self._channel = channel(self.target)
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        await self._control.close()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    # -- transfer-engine path ---------------------------------------------------------------
    async def allocate(self, hashes: Sequence[bytes], tail_key: str = "", request_id: str = "",
                       lease_ms: int = 0, writer_keeps_copy: bool = False, hold_ms: int = 0) -> Allocation:
        """writer_keeps_copy: these blocks stay in our own cache too; hold_ms > 0: a handoff, the
        store holds the blocks for their reader (see AllocatePutRequest)."""
        resp = await self._control.call("allocate_put", dict(
            profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key, lease_ms=lease_ms,
            request_id=request_id, writer_keeps_copy=writer_keeps_copy, hold_ms=hold_ms), self.timeout_s)
        return Allocation(resp.lease_id, slots_from_pb(resp.slots), resp.hold_lease_id)

    async def write(self, slots: SlotColumns, local_addrs: Sequence[int]) -> int:
        """Write the blocks whose slot says WRITE; returns the slices used."""
        if len(local_addrs) != len(slots):
            raise ValueError(f"write: {len(local_addrs)} local addresses for {len(slots)} slots")
        spans = block_spans(local_addrs, slots.addresses, self.block_nbytes, slots.states, pb.SLOT_STATE_WRITE)
        return await asyncio.to_thread(self._require_transfer().write, self.segment, spans)

    async def commit(self, lease_id: str, keys: Sequence[bytes] = (), tail_ttl_ms: int = 0) -> pb.CommitPutResponse:
        return await self._control.call("commit_put", dict(lease_id=lease_id, keys=keys, tail_ttl_ms=tail_ttl_ms),
                                        self.timeout_s)

    async def put(self, hashes: Sequence[bytes], local_addrs: Sequence[int], tail_key: str = "",
                  request_id: str = "", lease_ms: int = 0, tail_ttl_ms: int = 0,
                  writer_keeps_copy: bool = False) -> PutResult:
        """Allocate, write, commit. On failure the lease is released, so nothing is stranded."""
        alloc = await self.allocate(hashes, tail_key, request_id, lease_ms, writer_keeps_copy)
        try:
            slices = await self.write(alloc.slots, local_addrs)
            await self.commit(alloc.lease_id, tail_ttl_ms=tail_ttl_ms)
        except BaseException:
            await asyncio.shield(self._release_quietly(alloc.lease_id))  # even when we are cancelled
            raise
        states = alloc.slots.states
        return PutResult(states.count(pb.SLOT_STATE_WRITE), states.count(pb.SLOT_STATE_PRESENT),
                         states.count(pb.SLOT_STATE_PENDING), slices)

    async def get(self, hashes: Sequence[bytes], local_addrs: Sequence[int], tail_key: str = "",
                  tail_addr: int | None = None, request_id: str = "", lease_ms: int = 0) -> GetResult:
        """Read the longest stored prefix of `hashes` (and the tail) into local memory."""
        pinned = await self.pin(hashes, tail_key, request_id, lease_ms)
        if not pinned.lease_id:
            return GetResult(0, False, 0)
        try:
            # The prefix found may be shorter than local_addrs.
            spans = block_spans(local_addrs[: len(pinned.slots)], pinned.slots.addresses, self.block_nbytes)
            if pinned.tail is not None:
                if tail_addr is None:
                    raise ValueError("the store has a tail block but no tail_addr was given")
                spans.append(Span(tail_addr, pinned.tail.address, self.block_nbytes))
            slices = await asyncio.to_thread(self._require_transfer().read, self.segment, spans)
        finally:
            self.release_soon(pinned.lease_id)
        return GetResult(len(pinned.slots), pinned.tail is not None, slices)

    async def pin(self, hashes: Sequence[bytes], tail_key: str = "", request_id: str = "",
                  lease_ms: int = 0) -> Pinned:
        """Pin the longest stored prefix under a lease (release it, or it lapses)."""
        resp = await self._control.call("get", dict(
            profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key, lease_ms=lease_ms,
            request_id=request_id), self.timeout_s)
        tail = slot_from_pb(resp.tail) if resp.HasField("tail") else None
        return Pinned(resp.lease_id, slots_from_pb(resp.slots), tail)

    async def watch(self, hashes: Sequence[bytes], tail_key: str = "", request_id: str = "",
                    lease_ms: int = 0, timeout_s: float | None = None) -> AsyncIterator[WatchBatch]:
        """Batches of blocks as they are committed (each already pinned under the watch's lease)."""
        call = self.stub.Watch(pb.WatchRequest(
            profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key, lease_ms=lease_ms,
            request_id=request_id), timeout=timeout_s or self.timeout_s)
        try:
            async for event in call:
                yield WatchBatch(event.lease_id, list(event.indices), slots_from_pb(event.slots))
        finally:
            call.cancel()

    async def read_slots(self, slots: SlotColumns, local_addrs: Sequence[int]) -> int:
        spans = block_spans(local_addrs, slots.addresses, self.block_nbytes)
        return await asyncio.to_thread(self._require_transfer().read, self.segment, spans)

    async def release(self, lease_id: str) -> pb.ReleaseLeaseResponse:
        return await self._control.call("release_lease", dict(lease_id=lease_id), self.timeout_s)

    async def renew(self, lease_id: str, lease_ms: int = 0) -> None:
        await self._control.call("renew_lease", dict(lease_id=lease_id, lease_ms=lease_ms),
                                 self.timeout_s)

    def keep_alive(self, lease_id: str, lease_ms: int) -> asyncio.Task:
        """Renew a lease every third of its length until the returned task is cancelled."""
        async def renew_forever() -> None:
            while True:
                await asyncio.sleep(lease_ms / 3000)
                try:
                    await self.renew(lease_id, lease_ms)
                except grpc.aio.AioRpcError:
                    return  # closed (fully committed) or lapsed: nothing left to keep

        return asyncio.ensure_future(renew_forever())

    def release_soon(self, lease_id: str) -> None:
        """End a lease without waiting for the answer: a reader has its bytes once the read
        returns, and its next step should not wait a round trip for the store to unpin. The
        call runs as a task this client owns; close() waits for those still in flight."""
        task = asyncio.ensure_future(self._release_quietly(lease_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_quietly(self, lease_id: str) -> None:
        try:
            await self.release(lease_id)
        except grpc.aio.AioRpcError as e:
            # The store lapses a lease on its own; NOT_FOUND means it already has.
            if e.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("lease release failed; the store lapses it on its own", lease_id=lease_id,
                            code=e.code().name, message=e.details())

    def _require_transfer(self) -> Transfer:
        if self.transfer is None:
            raise RuntimeError("this StoreClient has no transfer engine: use put_bytes/get_bytes")
        if not self.segment:
            raise RuntimeError("call connect() first")
        return self.transfer

    # -- gRPC-bytes path --------------------------------------------------------------------
    async def put_bytes(self, hashes: Sequence[bytes], data: bytes, tail_key: str = "", tail_lease_ms: int = 0,
                        request_id: str = "", chunk_bytes: int = 1024 * 1024) -> pb.PutBytesResponse:
        header = pb.PutBytesHeader(profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key,
                                   tail_lease_ms=tail_lease_ms, request_id=request_id)

        def messages():
            yield pb.PutBytesRequest(header=header)
            view = memoryview(data)
            for i in range(0, len(data), chunk_bytes):
                yield pb.PutBytesRequest(data=bytes(view[i : i + chunk_bytes]))

        return await self.stub.PutBytes(messages(), timeout=self.timeout_s)

    async def get_bytes(self, hashes: Sequence[bytes], tail_key: str = "",
                        request_id: str = "") -> tuple[int, bool, bytes]:
        """(blocks incl. the tail, has_tail, their bytes in order)."""
        call = self.stub.GetBytes(pb.GetBytesRequest(profile=self.profile_pb, block_hashes=hashes_to_pb(hashes),
                                                     tail_key=tail_key, request_id=request_id),
                                  timeout=self.timeout_s)
        head = None
        parts = []
        async for msg in call:
            if head is None:
                head = msg
            else:
                parts.append(msg.data)
        return head.num_blocks, head.has_tail, b"".join(parts)

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
