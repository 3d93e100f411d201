"""KVStore gRPC servicer: protobuf in, `BlockStore` calls, protobuf out."""

from __future__ import annotations

import asyncio
import struct
import time
from collections import Counter

from pdserve import logs
from pdserve.errors import DataLoss, FailedPrecondition, InvalidArgument, PdserveError
from pdserve.kv.checksum import checksum_of
from pdserve.kv.layout import HashProfile
from pdserve.rpc.convert import hashes_from_pb, profile_to_pb, require_profile
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc
from services.kvstore.blocks import Block
from services.kvstore.cluster import ClusterTier
from services.kvstore.store import DEVICE, DRAM, BlockStore, Slot, SlotState

log = logs.get("kvstore")

CLIENT_ID_KEY = "pdserve-client-id"  # gRPC metadata: who opens and owns a lease
_TIER = {DEVICE: pb.TIER_DEVICE, DRAM: pb.TIER_DRAM}
_STATE = {SlotState.WRITE: pb.SLOT_STATE_WRITE, SlotState.PRESENT: pb.SLOT_STATE_PRESENT,
          SlotState.PENDING: pb.SLOT_STATE_PENDING}
CHUNK_BYTES = 1024 * 1024  # bytes per GetBytes message
_METHOD = "/pdserve.v1.KVStore/"  # (Stats reports the store's own calls, not health checks')


def _unix_ms(deadline_monotonic: float) -> int:
    return int((time.time() + deadline_monotonic - time.monotonic()) * 1000)


def _tail(key: str) -> bytes | None:
    return ("tail:" + key).encode() if key else None


def client_id(context) -> str:
    """The caller's client id (metadata `pdserve-client-id`), required on calls that touch leases."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_KEY and value:
            return value
    raise InvalidArgument(f"name your client: metadata {CLIENT_ID_KEY!r} is missing")


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, profile: HashProfile, segment: str, device_kind: str,
                 max_blocks: int, redis_connected=lambda: False, unix_address: str = "",
                 cluster: ClusterTier | None = None, node: str = "local", calls: Counter[str] | None = None):
        self.store = store
        self.profile = profile
        self.profile_pb = profile_to_pb(profile)
        self.segment = segment
        self.device_kind = device_kind
        self.max_blocks = max_blocks
        self.redis_connected = redis_connected
        self.unix_address = unix_address
        self.cluster = cluster
        self.node = node
        self.calls = calls if calls is not None else Counter()  # counted by the server (build_server)

    def _hashes(self, profile, raw: bytes, request_id: str = "") -> list[bytes]:
        logs.bind_request_id(request_id)
        if profile is not None and profile != self.profile_pb:  # the same message as ours is the common case
            require_profile(profile, self.profile)
        hashes_from_pb(raw, self.max_blocks)  # checks the length and the limit
        return [raw[i : i + 16] for i in range(0, len(raw), 16)]

    def _slot_list(self, slots: list[Slot], with_checksums: bool = False) -> pb.SlotList:
        blocks = self.store.blocks
        return pb.SlotList(
            addresses=struct.pack(f"<{len(slots)}Q", *(blocks.address(s.block) for s in slots)),
            tiers=bytes(_TIER[s.block.tier] for s in slots), states=bytes(_STATE[s.state] for s in slots),
            checksums=struct.pack(f"<{len(slots)}Q", *(s.block.checksum for s in slots)) if with_checksums else b"")

    def _read_list(self, blocks: list[Block]) -> pb.SlotList:
        return self._slot_list([Slot(b, SlotState.PRESENT) for b in blocks], with_checksums=True)

    def _slot(self, b: Block) -> pb.Slot:
        return pb.Slot(key=b.key, address=self.store.blocks.address(b), tier=_TIER[b.tier],
                       state=pb.SLOT_STATE_PRESENT, checksum=b.checksum)

    async def Info(self, request, context):
        return pb.InfoResponse(
            segment=self.segment, profile=self.profile_pb, block_nbytes=self.store.block_nbytes,
            device_capacity_blocks=self.store.tiers[DEVICE].info.num_slots,
            dram_capacity_blocks=self.store.tiers[DRAM].info.num_slots, device_kind=self.device_kind,
            unix_address=self.unix_address, node=self.node)

    async def AllocatePut(self, request, context):
        hashes = self._hashes(request.profile, request.block_hashes, request.request_id)
        lease, slots = self.store.allocate_put(client_id(context), hashes, _tail(request.tail_key), request.lease_ms,
                                               request.request_id, request.writer_keeps_copy, request.hold_ms)
        return pb.AllocatePutResponse(lease_id=lease.lease_id, slots=self._slot_list(slots),
                                      lease_deadline_unix_ms=_unix_ms(lease.deadline), hold_lease_id=lease.hold_id)

    async def CommitPut(self, request, context):
        hashes = self._hashes(None, request.block_hashes)
        count, closed = self.store.commit(client_id(context), request.lease_id, hashes, list(request.checksums),
                                          request.tail, request.tail_checksum, request.tail_ttl_ms)
        return pb.CommitPutResponse(committed=count, lease_closed=closed)

    async def Get(self, request, context):
        hashes = self._hashes(request.profile, request.block_hashes, request.request_id)
        owner = client_id(context)
        fetched = await self._from_cluster(hashes, context.time_remaining()) if self.cluster is not None else set()
        lease, blocks, tail = self.store.get(owner, hashes, _tail(request.tail_key), request.lease_ms,
                                             request.request_id)
        if lease is None:
            return pb.GetResponse()
        return pb.GetResponse(lease_id=lease.lease_id, slots=self._read_list(blocks),
                              tail=self._slot(tail) if tail is not None else None,
                              lease_deadline_unix_ms=_unix_ms(lease.deadline),
                              from_cluster=sum(b.key in fetched for b in blocks))

    async def _from_cluster(self, hashes: list[bytes], time_remaining: float | None) -> set[bytes]:
        """Where the local run of `hashes` ends, fetch what follows from the cluster, in rounds of
        what the staging buffer holds, into local slots; the keys it placed (they end the local run
        the get then pins: nothing awaits between; one evicted between rounds is fetched again).
        The rounds share one deadline, within the caller's (`time_remaining`): past it, a miss."""
        deadline = self.cluster.deadline(time_remaining)
        start = self.store.committed_run(hashes)
        fetched: set[bytes] = set()
        while start < len(hashes):
            run = await self.cluster.fetch(hashes[start:], deadline)
            if not run:
                return fetched
            try:
                placed = self.store.adopt(hashes[:start], [f.key for f in run], [f.checksum for f in run],
                                          [f.view for f in run])
            finally:
                self.cluster.done_with(run)
            fetched.update(f.key for f in run[:placed])
            if placed < len(run):
                return fetched
            start = self.store.committed_run(hashes)
        return fetched

    async def RenewLease(self, request, context):
        deadline = self.store.renew(client_id(context), request.lease_id, request.lease_ms)
        return pb.RenewLeaseResponse(lease_deadline_unix_ms=_unix_ms(deadline))

    async def ReleaseLease(self, request, context):
        owner = client_id(context)
        if not request.lease_ids:
            unpinned, fenced = self.store.release(owner, request.lease_id)
            return pb.ReleaseLeaseResponse(unpinned=unpinned, reclaimed=fenced)
        if request.lease_id:
            raise InvalidArgument("ReleaseLease: give lease_id or lease_ids, not both")
        out = pb.ReleaseLeaseResponse()
        for lease_id in request.lease_ids:
            try:
                unpinned, fenced = self.store.release(owner, lease_id)
            except PdserveError as e:
                out.refused.add(lease_id=lease_id, code=e.code.name, message=str(e))
                continue
            out.unpinned += unpinned
            out.reclaimed += fenced
        return out

    async def ReportCorrupt(self, request, context):
        hashes = self._hashes(None, request.block_hashes)
        dropped = self.store.report_corrupt(client_id(context), request.lease_id, hashes, request.tail)
        log.warning("reader reported blocks failing their checksum", lease_id=request.lease_id,
                    reported=len(hashes) + request.tail, dropped=dropped)
        return pb.ReportCorruptResponse(dropped=dropped)

    async def Watch(self, request, context):
        hashes = self._hashes(request.profile, request.block_hashes, request.request_id)
        watcher = self.store.watch(client_id(context), hashes, _tail(request.tail_key), request.lease_ms,
                                   request.request_id)
        total = len(hashes) + bool(request.tail_key)
        delivered = 0
        try:
            while delivered < total:
                ready = [await watcher.queue.get()]
                while not watcher.queue.empty():
                    ready.append(watcher.queue.get_nowait())
                delivered += len(ready)
                yield pb.WatchEvent(lease_id=watcher.lease.lease_id, indices=[i for i, _ in ready],
                                    slots=self._read_list([b for _, b in ready]))
            # Every block delivered: the client reads them, then ends the stream (or its deadline
            # or keepalive does), and the lease goes with it: no release call needed.
            await asyncio.get_running_loop().create_future()
        finally:
            self.store.end_watch(watcher)

    async def PutBytes(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("PutBytes: the first message must be the header")
        h = first.header
        hashes = self._hashes(h.profile, h.block_hashes, h.request_id)
        lease, slots = self.store.allocate_put("", hashes, _tail(h.tail_key), h.tail_lease_ms, h.request_id)
        nbytes = self.store.block_nbytes
        expected = len(slots) * nbytes
        received = 0
        writes = any(s.state == SlotState.WRITE for s in slots)  # (else the lease closed at once: all here)
        try:
            async for msg in request_iterator:
                if not msg.HasField("data"):
                    raise InvalidArgument("PutBytes: only data messages may follow the header")
                if received + len(msg.data) > expected:
                    raise InvalidArgument(f"PutBytes: more bytes than {len(slots)} blocks of {nbytes} bytes")
                if writes:
                    self._require_open(lease)
                self._write_span(slots, received, msg.data)
                received += len(msg.data)
            if received != expected:
                raise InvalidArgument(f"PutBytes: got {received} bytes, expected {expected} "
                                      f"({len(slots)} blocks of {nbytes} bytes)")
        except BaseException:
            self.store.abandon(lease)
            raise
        # Only WRITE slots took bytes: a block already here keeps the bytes it has.
        written = [s.block for s in slots if s.state == SlotState.WRITE]
        if written:
            self._require_open(lease)
            full = [b for b in written if not b.is_tail]
            tail = written[-1] if written[-1].is_tail else None
            self.store.commit("", lease.lease_id, [b.key for b in full], [checksum_of(self._view(b)) for b in full],
                              tail is not None, checksum_of(self._view(tail)) if tail else 0, h.tail_lease_ms)
        return pb.PutBytesResponse(written=len(written),
                                   already_present=sum(s.state == SlotState.PRESENT for s in slots),
                                   pending=sum(s.state == SlotState.PENDING for s in slots))

    def _require_open(self, lease) -> None:
        """A PutBytes stream slower than its write lease: the lease lapsed and its slots were fenced,
        so nothing more is written or committed under it."""
        if lease.lease_id not in self.store.leases:
            raise FailedPrecondition("PutBytes: the write lease lapsed before the stream ended (tail_lease_ms or "
                                     "the store's lease is shorter than the upload took): nothing was stored; "
                                     "send it again, faster or with a longer tail_lease_ms")

    def _write_span(self, slots: list[Slot], offset: int, data: bytes) -> None:
        import torch

        nbytes = self.store.block_nbytes
        pos = 0
        while pos < len(data):
            block, within = divmod(offset + pos, nbytes)
            take = min(nbytes - within, len(data) - pos)
            if slots[block].state == SlotState.WRITE:  # (pinned by the put's lease: its slot holds)
                src = torch.frombuffer(bytearray(data[pos : pos + take]), dtype=torch.uint8)
                self._view(slots[block].block)[within : within + take].copy_(src)
            pos += take

    def _view(self, b: Block):
        return self.store.blocks.view(b)

    async def GetBytes(self, request, context):
        hashes = self._hashes(request.profile, request.block_hashes, request.request_id)
        lease, blocks, tail = self.store.get("", hashes, _tail(request.tail_key), 0, request.request_id,
                                             streaming=True)
        if lease is None:
            yield pb.GetBytesResponse(num_blocks=0, has_tail=False)
            return
        try:
            # The store reads these itself: it verifies them as every reader does.
            bad = [b for b in [*blocks, *([tail] if tail else [])] if not self.store.blocks.verify(b)]
            if bad:
                self.store.drop_corrupt(bad)
                raise DataLoss(f"GetBytes: {len(bad)} stored blocks failed their checksum and were dropped; "
                               "recompute them")
            out = [*blocks, *([tail] if tail else [])]
            yield pb.GetBytesResponse(num_blocks=len(out), has_tail=tail is not None)
            buf = bytearray()
            for b in out:  # (pinned by the get's lease)
                buf += self._view(b).cpu().numpy().tobytes()
                while len(buf) >= CHUNK_BYTES:
                    yield pb.GetBytesResponse(data=bytes(buf[:CHUNK_BYTES]))
                    del buf[:CHUNK_BYTES]
            if buf:
                yield pb.GetBytesResponse(data=bytes(buf))
        finally:
            if lease.lease_id in self.store.leases:
                self.store.release("", lease.lease_id)

    async def Stats(self, request, context):
        c = self.store.counters
        tiers = [pb.TierStats(tier=_TIER[tier], promotions=c.promotions if tier == DEVICE else 0,
                              **self.store.tier_stats(tier)) for tier in (DEVICE, DRAM)]
        return pb.StatsResponse(
            tiers=tiers, hits=c.hits, misses=c.misses, bytes_written=c.bytes_written, bytes_read=c.bytes_read,
            active_leases=len(self.store.leases), watchers=self.store.num_waiting(),
            redis_connected=self.redis_connected(), corrupt_blocks=c.corrupt,
            fenced_blocks=self.store.blocks.num_fenced(),
            cluster=pb.ClusterStats(**self.cluster.counters.as_dict()) if self.cluster is not None else None,
            calls={m.removeprefix(_METHOD): n for m, n in self.calls.items() if m.startswith(_METHOD)})
