"""KVStore gRPC servicer: protobuf in, `BlockStore` calls, protobuf out."""

from __future__ import annotations

import time

import grpc
import numpy as np

from pdserve import logs, telemetry
from pdserve.errors import InvalidArgument
from pdserve.kv.control_frames import set_fields
from pdserve.kv.layout import HashProfile
from pdserve.server import refusal
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc
from pdserve.wire import hashes_from_pb, profile_to_pb, require_profile
from services.kvstore.entries import TIER_CODE
from services.kvstore.store import DEVICE, DRAM, BlockStore, SlotRef, Slots, SlotState
from services.kvstore.views import tier_stats

log = logs.get("kvstore")

_TIER = {DEVICE: pb.TIER_DEVICE, DRAM: pb.TIER_DRAM}
_STATE = {SlotState.WRITE: pb.SLOT_STATE_WRITE, SlotState.PRESENT: pb.SLOT_STATE_PRESENT,
          SlotState.PENDING: pb.SLOT_STATE_PENDING}


def _translation(codes: dict[int, int]) -> bytes:
    """A bytes.translate table: the store's one-byte code -> the protocol's."""
    table = bytearray(256)
    for ours, theirs in codes.items():
        table[ours] = theirs
    return bytes(table)


# The same for a whole column of one-byte codes at once (Slots.tier_codes, Slots.states).
_TIER_TABLE = _translation({TIER_CODE[tier]: code for tier, code in _TIER.items()})
_STATE_TABLE = _translation(_STATE)
CHUNK_BYTES = 1024 * 1024  # bytes per GetBytes message
# Control socket: the oneof field of each call (also its handler here) -> its unary RPC's name.
_CONTROL = {"allocate_put": "AllocatePut", "commit_put": "CommitPut", "get": "Get", "renew_lease": "RenewLease",
            "release_lease": "ReleaseLease"}


def _slot_pb(ref: SlotRef) -> pb.Slot:
    return pb.Slot(key=ref.key, address=ref.address, tier=_TIER[ref.tier], state=_STATE[ref.state])


def _slots_fields(slots: Slots) -> dict:
    """A SlotList's fields, each column as one bytes object (a message is built once, where it
    goes: building one and then placing it in another copies it)."""
    return {"addresses": slots.addresses.tobytes(), "tiers": slots.tier_codes.translate(_TIER_TABLE),
            "states": slots.states.translate(_STATE_TABLE)}


def _unix_ms(deadline_monotonic: float) -> int:
    return int((time.time() + deadline_monotonic - time.monotonic()) * 1000)


def _tail(key: str) -> bytes | None:
    return ("tail:" + key).encode() if key else None


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, profile: HashProfile, segment: str, device_kind: str,
                 max_blocks: int, redis_connected=lambda: False):
        self.control_port = 0  # set once the control socket listens
        self.control_unix_name = ""  # (the same socket for clients on this host, if offered)
        self.store = store
        self.profile = profile
        self.profile_pb = profile_to_pb(profile)
        self.segment = segment
        self.device_kind = device_kind
        self.max_blocks = max_blocks
        self.redis_connected = redis_connected

    def _check(self, profile, hashes: bytes, request_id: str) -> np.ndarray:
        """The request's hashes, packed as the store keeps them (table.pack)."""
        logs.bind_request_id(request_id)
        if profile != self.profile_pb:  # the same message as ours is the common case, and cheap to see
            require_profile(profile, self.profile)
        return hashes_from_pb(hashes, self.max_blocks)

    async def Info(self, request, context):
        return pb.InfoResponse(
            segment=self.segment, profile=self.profile_pb, block_nbytes=self.store.block_nbytes,
            device_capacity_blocks=self.store.tiers[DEVICE].info.num_slots,
            dram_capacity_blocks=self.store.tiers[DRAM].info.num_slots, device_kind=self.device_kind,
            control_port=self.control_port, control_unix_name=self.control_unix_name)

    # -- control calls: served alike as unary RPCs and on the control socket; each returns
    # its response's fields, made into the message where it goes (alone, or in a ControlResponse).
    def allocate_put(self, request: pb.AllocatePutRequest) -> dict:
        hashes = self._check(request.profile, request.block_hashes, request.request_id)
        lease, refs = self.store.allocate_put(hashes, _tail(request.tail_key), request.lease_ms, request.request_id,
                                              request.writer_keeps_copy, request.hold_ms)
        return {"lease_id": lease.lease_id, "slots": _slots_fields(refs),
                "lease_deadline_unix_ms": _unix_ms(lease.deadline), "hold_lease_id": lease.hold_id}

    def commit_put(self, request: pb.CommitPutRequest) -> dict:
        keys = list(request.keys) or None
        count, closed = self.store.commit(request.lease_id, keys, request.tail_ttl_ms)
        return {"committed": count, "lease_closed": closed}

    def get(self, request: pb.GetRequest) -> dict:
        hashes = self._check(request.profile, request.block_hashes, request.request_id)
        lease, refs, tail = self.store.get(hashes, _tail(request.tail_key), request.lease_ms, request.request_id)
        if lease is None:
            return {}
        return {"lease_id": lease.lease_id, "slots": _slots_fields(refs), "tail": _slot_pb(tail) if tail else None,
                "lease_deadline_unix_ms": _unix_ms(lease.deadline)}

    def renew_lease(self, request: pb.RenewLeaseRequest) -> dict:
        deadline = self.store.leases.renew(request.lease_id, request.lease_ms)
        return {"lease_deadline_unix_ms": _unix_ms(deadline)}

    def release_lease(self, request: pb.ReleaseLeaseRequest) -> dict:
        unpinned, reclaimed = self.store.release(request.lease_id)
        return {"unpinned": unpinned, "reclaimed": reclaimed}

    def control(self, request: pb.ControlRequest) -> pb.ControlResponse:
        """One control-socket call: answered with the result, or with the status and message
        the unary call would have ended with."""
        call = request.WhichOneof("call")
        if call is None:
            return pb.ControlResponse(call_id=request.call_id, status_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                      status_message="control: the message names no call")
        method = _CONTROL[call]
        try:
            with telemetry.message_span(f"/pdserve.v1.KVStore/{method}", request.trace_context):
                result = getattr(self, call)(getattr(request, call))
        except Exception as e:  # noqa: BLE001 - a failed call is answered; the connection goes on
            code, message = refusal(e, f"control/{method}")
            return pb.ControlResponse(call_id=request.call_id, status_code=code.value[0], status_message=message)
        return pb.ControlResponse(call_id=request.call_id, **{call: set_fields(result)})

    async def AllocatePut(self, request, context):
        return pb.AllocatePutResponse(**self.allocate_put(request))

    async def CommitPut(self, request, context):
        return pb.CommitPutResponse(**self.commit_put(request))

    async def Get(self, request, context):
        return pb.GetResponse(**self.get(request))

    async def RenewLease(self, request, context):
        return pb.RenewLeaseResponse(**self.renew_lease(request))

    async def ReleaseLease(self, request, context):
        return pb.ReleaseLeaseResponse(**self.release_lease(request))

    async def Watch(self, request, context):
        hashes = self._check(request.profile, request.block_hashes, request.request_id)
        watcher = self.store.watch(hashes, _tail(request.tail_key), request.lease_ms, request.request_id)
        total = len(hashes) + (1 if request.tail_key else 0)
        delivered = 0
        try:
            while delivered < total:
                ready = [await watcher.queue.get()]
                while not watcher.queue.empty():
                    ready.append(watcher.queue.get_nowait())
                delivered += len(ready)
                yield pb.WatchEvent(lease_id=watcher.lease.lease_id, indices=[i for i, _ in ready],
                                    slots=_slots_fields(Slots.of([ref for _, ref in ready])))
        finally:
            # Complete: the client reads, then releases (or the lease lapses). Cut short: the
            # client is gone or gave up, so nothing it pinned may stay pinned.
            self.store.end_watch(watcher, release=delivered < total)

    async def PutBytes(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("PutBytes: the first message must be the header")
        h = first.header
        hashes = self._check(h.profile, h.block_hashes, h.request_id)
        lease, refs = self.store.allocate_put(hashes, _tail(h.tail_key), h.tail_lease_ms, h.request_id)
        nbytes = self.store.block_nbytes
        expected = len(refs) * nbytes
        received = 0
        try:
            async for msg in request_iterator:
                if not msg.HasField("data"):
                    raise InvalidArgument("PutBytes: only data messages may follow the header")
                data = msg.data
                if received + len(data) > expected:
                    raise InvalidArgument(f"PutBytes: more bytes than {len(refs)} blocks of {nbytes} bytes")
                self._write_span(refs, received, data)
                received += len(data)
            if received != expected:
                raise InvalidArgument(f"PutBytes: got {received} bytes, expected {expected} "
                                      f"({len(refs)} blocks of {nbytes} bytes)")
        except BaseException:
            if lease.lease_id in self.store.leases:
                self.store.release(lease.lease_id)  # reclaim what was never committed
            raise
        written = refs.states.count(SlotState.WRITE)
        if lease.lease_id in self.store.leases:
            self.store.commit(lease.lease_id, tail_ttl_ms=h.tail_lease_ms)
        return pb.PutBytesResponse(written=written, already_present=len(refs) - written)

    def _write_span(self, refs: Slots, offset: int, data: bytes) -> None:
        nbytes = self.store.block_nbytes
        pos = 0
        while pos < len(data):
            block, within = divmod(offset + pos, nbytes)
            take = min(nbytes - within, len(data) - pos)
            if refs.states[block] == SlotState.WRITE:  # (pinned by the put's lease: its row holds)
                view = self._view(int(refs.rows[block]))
                view[within : within + take].copy_(_as_tensor(data[pos : pos + take]))
            pos += take

    def _view(self, row: int):
        """The bytes of the block in a row (a pinned one: it stays there)."""
        t = self.store.table
        return self.store.tiers[t.tier_of(row)].view(t.slot_of(row))

    async def GetBytes(self, request, context):
        hashes = self._check(request.profile, request.block_hashes, request.request_id)
        lease, refs, tail = self.store.get(hashes, _tail(request.tail_key), 0, request.request_id)
        rows = [*refs.rows.tolist(), *([tail.row] if tail else [])]
        yield pb.GetBytesResponse(num_blocks=len(rows), has_tail=tail is not None)
        if lease is None:
            return
        try:
            buf = bytearray()
            for row in rows:  # (pinned by the get's lease)
                buf += self._view(row).cpu().numpy().tobytes()
                while len(buf) >= CHUNK_BYTES:
                    yield pb.GetBytesResponse(data=bytes(buf[:CHUNK_BYTES]))
                    del buf[:CHUNK_BYTES]
            if buf:
                yield pb.GetBytesResponse(data=bytes(buf))
        finally:
            self.store.release(lease.lease_id)

    async def Stats(self, request, context):
        c = self.store.counters
        tiers = []
        for tier in (DEVICE, DRAM):
            s = tier_stats(self.store, tier)
            tiers.append(pb.TierStats(tier=_TIER[tier], promotions=c.promotions if tier == DEVICE else 0, **s))
        return pb.StatsResponse(
            tiers=tiers, hits=c.hits, misses=c.misses, bytes_written=c.bytes_written, bytes_read=c.bytes_read,
            active_leases=len(self.store.leases), watchers=self.store.watchers.count(),
            redis_connected=self.redis_connected())


def _as_tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
