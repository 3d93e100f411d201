"""Client of the KV store: control plane over gRPC, bytes over the transfer engine (or gRPC).

Returns dataclasses, never protobuf. Every block it writes is committed with its checksum, and
every block it reads is verified against the writer's checksum before the caller may use it: a
block that fails is reported to the store (which drops its copy when that is bad) and is never
counted as read.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Sequence

import grpc

from pdserve import logs
from pdserve.errors import Unavailable
from pdserve.kv.checksum import checksums_at, mismatches
from pdserve.kv.layout import HashProfile
from pdserve.kvclient.releases import ALREADY_ENDED, ReleaseBatcher, keep_alive
from pdserve.kvclient.results import (
    PENDING,
    PRESENT,
    WRITE,
    Allocation,
    GetResult,
    Pinned,
    PutResult,
    Released,
    Slots,
    StoreInfo,
    StoreStats,
    WatchBatch,
    slots_from_pb,
    stats_from_pb,
)
from pdserve.kvclient.transfer import Span, Transfer, TransferError, block_spans
from pdserve.rpc.convert import hashes_to_pb, profile_from_pb, profile_to_pb
from pdserve.runtime.server import channel
from pdserve.runtime.tasks import to_thread_to_end
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

log = logs.get("kv.client")
CLIENT_ID_KEY = "pdserve-client-id"


class StoreClient:
    """One store, one profile. Local addresses must lie in memory registered with `transfer`.
    Owns its channels and its client id (the store's leases answer to it alone)."""

    def __init__(self, target: str, profile: HashProfile, transfer: Transfer | None = None,
                 timeout_s: float = 5.0):
        self.target = target
        self.profile = profile
        self.profile_pb = profile_to_pb(profile)
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.client_id = secrets.token_hex(16)
        self._metadata = ((CLIENT_ID_KEY, self.client_id),)
        self._channels: list[grpc.aio.Channel] = []  # made on first use, bound to the running loop
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self.segment = ""
        self.address_used = ""  # the store's Unix address when this host reaches it, else `target`
        self.block_nbytes = profile.layout.block_nbytes
        self._releases = ReleaseBatcher(lambda ids: self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=ids)))
        self._connecting: asyncio.Future | None = None
        self._closing: set[asyncio.Future] = set()  # channels replaced by a reconnect, closing once idle

    async def connect(self) -> StoreInfo:
        """Ask the store where it is (its transfer-engine segment) and switch to its Unix address
        when this host reaches it. The channels it replaces close once the calls on them have
        ended (within the client's timeout): finding the store again never cuts a call short."""
        opened = [channel(self.target)]
        try:
            stub, address = kvstore_pb2_grpc.KVStoreStub(opened[0]), self.target
            info = await stub.Info(pb.InfoRequest(), timeout=self.timeout_s)
            if info.unix_address:
                unix = channel(info.unix_address)
                try:
                    await kvstore_pb2_grpc.KVStoreStub(unix).Info(pb.InfoRequest(), timeout=min(self.timeout_s, 1.0))
                    opened.append(unix)
                    stub, address = kvstore_pb2_grpc.KVStoreStub(unix), info.unix_address
                except grpc.aio.AioRpcError:
                    await unix.close()  # another host or network namespace: TCP it is
        except BaseException:
            await opened[0].close()
            raise
        replaced, self._channels = self._channels, opened
        self._stub, self.address_used, self.segment = stub, address, info.segment
        for closing in [asyncio.ensure_future(ch.close(grace=self.timeout_s)) for ch in replaced]:
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        return StoreInfo(info.segment, info.unix_address, profile_from_pb(info.profile), info.block_nbytes,
                         info.device_capacity_blocks, info.dram_capacity_blocks, info.device_kind,
                         info.node or "local")

    async def _reconnect(self) -> None:
        """`connect`, once for every caller that asks while it runs."""
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self.connect())
        await asyncio.shield(self._connecting)

    async def _stub_ready(self) -> kvstore_pb2_grpc.KVStoreStub:
        if self._stub is None:  # (connect first)
            try:
                await self._reconnect()
            except grpc.aio.AioRpcError as e:
                raise self._named(e) from None
        return self._stub

    async def _call(self, method: str, request, retry: bool = True):
        """One unary call. UNAVAILABLE on the Unix address (the store restarted: its address and
        segment changed): find it again (unless another call did meanwhile) and retry once."""
        stub = await self._stub_ready()
        try:
            return await getattr(stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            if not (retry and e.code() == grpc.StatusCode.UNAVAILABLE and self.address_used != self.target):
                raise self._named(e) from None
        if self._stub is stub:
            try:
                await self._reconnect()
            except grpc.aio.AioRpcError as e:
                raise self._named(e) from None
        return await self._call(method, request, retry=False)

    def _named(self, e: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
        """The error, its details saying it was the store that did not answer, and where."""
        if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return e
        return grpc.aio.AioRpcError(e.code(), e.initial_metadata(), e.trailing_metadata(),
                                    f"kvstore at {self.target} did not answer ({e.code().name}: {e.details()})")

    async def close(self) -> None:
        await self._releases.drain()
        channels, self._channels, self._stub = self._channels, [], None
        for ch in channels:
            await ch.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    # -- transfer-engine path: writes ---------------------------------------------------------
    async def allocate(self, hashes: Sequence[bytes], tail_key: str = "", request_id: str = "",
                       lease_ms: int = 0, writer_keeps_copy: bool = False, hold_ms: int = 0) -> Allocation:
        """writer_keeps_copy: these blocks stay in our own cache too; hold_ms > 0: a handoff, the
        store holds the blocks for their reader (see AllocatePutRequest)."""
        resp = await self._call("AllocatePut", pb.AllocatePutRequest(
            profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key, lease_ms=lease_ms,
            request_id=request_id, writer_keeps_copy=writer_keeps_copy, hold_ms=hold_ms))
        return Allocation(resp.lease_id, list(hashes), slots_from_pb(resp.slots), bool(tail_key), resp.hold_lease_id)

    async def write(self, slots: Slots, local_addrs: Sequence[int]) -> tuple[int, dict[int, int]]:
        """Write the blocks whose slot says WRITE (not committed: see `ship`), checksumming each
        span as soon as it has landed, while the others move: its bytes are still in the CPU's
        cache then, and every span is submitted at once (docs/perf-log.md, S47); returns the slices
        used and each written block's checksum by its local address."""
        if len(local_addrs) != len(slots):
            raise ValueError(f"write: {len(local_addrs)} local addresses for {len(slots)} slots")
        nbytes, sums = self.block_nbytes, {}

        def checksum(span: Span) -> None:
            addrs = span.blocks(nbytes)
            sums.update(zip(addrs, checksums_at(addrs, nbytes), strict=True))

        mine = [s == WRITE for s in slots.states]
        slices = await self._move(block_spans(local_addrs, slots.addresses, nbytes, mine), write=True, on_done=checksum)
        return slices, sums

    async def commit(self, lease_id: str, hashes: Sequence[bytes], checksums: Sequence[int], tail: bool = False,
                     tail_checksum: int = 0, tail_ttl_ms: int = 0) -> tuple[int, bool]:
        """Make written blocks readable, each with the checksum of its bytes; (committed, lease closed)."""
        resp = await self._call("CommitPut", pb.CommitPutRequest(
            lease_id=lease_id, block_hashes=hashes_to_pb(hashes), checksums=checksums, tail=tail,
            tail_checksum=tail_checksum, tail_ttl_ms=tail_ttl_ms))
        return resp.committed, resp.lease_closed

    async def ship(self, alloc: Allocation, start: int, end: int, local_addrs: Sequence[int],
                   tail_ttl_ms: int = 0, wait: bool = True) -> int:
        """Write the blocks [start, end) of an allocation whose slot says WRITE (index
        len(hashes) is the tail), checksumming them while they move, and commit them. wait=False:
        the commit's answer is awaited by `finish` (its consumer is the reader's Watch).
        Returns the slices used."""
        if len(local_addrs) != end - start:
            raise ValueError(f"ship: {len(local_addrs)} local addresses for blocks [{start}, {end})")
        slots = alloc.slots[start:end]
        picked = [i for i, state in zip(range(start, end), slots.states, strict=True) if state == WRITE]
        if not picked:
            return 0
        ours = [local_addrs[i - start] for i in picked]
        slices, by_addr = await self.write(slots, local_addrs)
        sums = [by_addr[a] for a in ours]
        tail = picked[-1] == len(alloc.hashes)
        full = picked[:-1] if tail else picked
        commit = asyncio.ensure_future(self.commit(alloc.lease_id, [alloc.hashes[i] for i in full], sums[: len(full)],
                                                   tail, sums[-1] if tail else 0, tail_ttl_ms))
        if wait:
            await commit
        else:
            alloc.commits.append(commit)
        return slices

    async def finish(self, alloc: Allocation) -> None:
        """Await the commits `ship(wait=False)` sent; the first refusal is raised."""
        commits, alloc.commits = alloc.commits, []
        for done in await asyncio.gather(*commits, return_exceptions=True):
            if isinstance(done, BaseException):
                raise done

    async def put(self, hashes: Sequence[bytes], local_addrs: Sequence[int], tail_key: str = "",
                  request_id: str = "", lease_ms: int = 0, tail_ttl_ms: int = 0,
                  writer_keeps_copy: bool = False) -> PutResult:
        """Allocate, write, commit (`local_addrs`: the blocks', then the tail's). On failure the
        lease is released, so nothing is stranded."""
        alloc = await self.allocate(hashes, tail_key, request_id, lease_ms, writer_keeps_copy)
        try:
            slices = await self.ship(alloc, 0, len(alloc.slots), local_addrs, tail_ttl_ms)
        except BaseException:
            if any(s == WRITE for s in alloc.slots.states):
                await asyncio.shield(self._release_quietly(alloc.lease_id))  # even when we are cancelled
            raise
        states = alloc.slots.states
        return PutResult(states.count(WRITE), states.count(PRESENT), states.count(PENDING), slices)

    # -- transfer-engine path: reads ----------------------------------------------------------
    async def pin(self, hashes: Sequence[bytes], tail_key: str = "", request_id: str = "",
                  lease_ms: int = 0) -> Pinned:
        """Pin the longest stored prefix under a lease (release it, or it lapses)."""
        resp = await self._call("Get", pb.GetRequest(
            profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key, lease_ms=lease_ms,
            request_id=request_id))
        if not resp.HasField("tail"):
            return Pinned(resp.lease_id, slots_from_pb(resp.slots), from_cluster=resp.from_cluster)
        return Pinned(resp.lease_id, slots_from_pb(resp.slots), resp.tail.address, resp.tail.checksum,
                      resp.from_cluster)

    async def read_slots(self, slots: Slots, local_addrs: Sequence[int]) -> list[int]:
        """Read blocks into local memory and verify them; returns the positions that failed their
        checksum (empty: every block is good)."""
        if len(local_addrs) != len(slots):
            raise ValueError(f"read: {len(local_addrs)} local addresses for {len(slots)} slots")
        nbytes = self.block_nbytes
        where = {a: i for i, a in enumerate(local_addrs)}
        bad: list[int] = []

        def verify(span: Span) -> None:  # each span as it lands, while the others still move
            ids = [where[a] for a in span.blocks(nbytes)]
            bad.extend(ids[j] for j in mismatches([local_addrs[i] for i in ids], nbytes,
                                                  [slots.checksums[i] for i in ids]))

        await self._move(block_spans(local_addrs, slots.addresses, nbytes), write=False, on_done=verify)
        return sorted(bad)

    async def get(self, hashes: Sequence[bytes], local_addrs: Sequence[int], tail_key: str = "",
                  tail_addr: int | None = None, request_id: str = "", lease_ms: int = 0) -> GetResult:
        """Read the longest stored prefix of `hashes` (and the tail) into local memory. Blocks
        that fail their checksum are reported; the result counts the good prefix only."""
        pinned = await self.pin(hashes, tail_key, request_id, lease_ms)
        if not pinned.lease_id:
            return GetResult(0, False, 0)
        try:
            n = len(pinned.slots)
            slots, addrs = pinned.slots, list(local_addrs[:n])
            if pinned.tail_address is not None:
                if tail_addr is None:
                    raise ValueError("the store has a tail block but no tail_addr was given")
                slots = Slots([*slots.addresses, pinned.tail_address], [*slots.states, PRESENT],
                              [*slots.tiers, 0], [*slots.checksums, pinned.tail_checksum])
                addrs.append(tail_addr)
            bad = await self.read_slots(slots, addrs)
            if bad:
                await self.report_corrupt(pinned.lease_id, [hashes[i] for i in bad if i < n], n in bad)
        finally:
            self.release_soon(pinned.lease_id)
        good = min([*bad, n])
        return GetResult(good, pinned.tail_address is not None and n not in bad, len(block_spans(
            addrs, slots.addresses, self.block_nbytes)), len(bad))

    async def report_corrupt(self, lease_id: str, hashes: Sequence[bytes], tail: bool = False) -> int:
        """Tell the store these blocks read under `lease_id` failed their checksum; returns how
        many it found bad in its own memory and dropped."""
        resp = await self._call("ReportCorrupt", pb.ReportCorruptRequest(
            lease_id=lease_id, block_hashes=hashes_to_pb(hashes), tail=tail))
        log.warning("KV blocks failed their checksum", lease_id=lease_id, blocks=len(hashes) + tail,
                    dropped_by_store=resp.dropped)
        return resp.dropped

    async def watch(self, hashes: Sequence[bytes], tail_key: str = "", request_id: str = "",
                    lease_ms: int = 0, timeout_s: float | None = None) -> AsyncIterator[WatchBatch]:
        """Batches of blocks as they are committed, each pinned under the watch's lease until the
        iteration ends: read a batch's slots in the loop's body. The lease ends with the stream
        (once the last batch has been read, or when the caller stops early), so none is released."""
        stub = await self._stub_ready()
        call = stub.Watch(pb.WatchRequest(
            profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key, lease_ms=lease_ms,
            request_id=request_id), timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        left = len(hashes) + bool(tail_key)
        try:
            while left:
                event = await call.read()
                if event is grpc.aio.EOF:
                    raise Unavailable(f"the store ended a watch with {left} blocks still to deliver")
                left -= len(event.indices)
                yield WatchBatch(event.lease_id, list(event.indices), slots_from_pb(event.slots))
        finally:
            call.cancel()

    async def _move(self, spans: list[Span], write: bool, on_done=None) -> int:
        transfer = self._require_transfer()
        if not self.segment:  # (Info through the channel in use: a call that fails on it finds the store again)
            self.segment = (await self._call("Info", pb.InfoRequest())).segment
        try:
            # The engine cannot stop a move: a cancelled one is waited out, so the caller never hands
            # on memory it may still land bytes in (a stopped peer holds it, and that memory).
            return await to_thread_to_end(transfer.write if write else transfer.read, self.segment, spans, on_done)
        except TransferError:
            self.segment = ""  # the store may have restarted elsewhere: ask again before the next move
            raise

    # -- leases ---------------------------------------------------------------------------------
    async def release(self, lease_id: str) -> Released:
        resp = await self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))
        return Released(resp.unpinned, resp.reclaimed)

    async def renew(self, lease_id: str, lease_ms: int = 0) -> None:
        await self._call("RenewLease", pb.RenewLeaseRequest(lease_id=lease_id, lease_ms=lease_ms))

    def keep_alive(self, lease_id: str, lease_ms: int) -> asyncio.Task:
        """Renew a lease every third of its length until the returned task is cancelled."""
        return keep_alive(lambda: self.renew(lease_id, lease_ms), lease_id, lease_ms)

    def release_soon(self, lease_id: str) -> None:
        """End a lease without waiting for the answer: a reader has its bytes once the read
        returns, and its next step should not wait a round trip for the store to unpin. Sent
        with the others of its moment (`ReleaseBatcher`); close() waits for them."""
        self._releases.add(lease_id)

    async def _release_quietly(self, lease_id: str) -> None:
        """End a lease and wait for it (a failed writer's, so that a retry finds its slots fenced)."""
        try:
            await self.release(lease_id)
        except grpc.aio.AioRpcError as e:
            if e.code().name not in ALREADY_ENDED:
                log.warning("lease release failed; the store lapses it on its own", lease_id=lease_id,
                            code=e.code().name, message=e.details())

    def _require_transfer(self) -> Transfer:
        if self.transfer is None:
            raise RuntimeError("this StoreClient has no transfer engine: use put_bytes/get_bytes")
        return self.transfer

    # -- gRPC-bytes path --------------------------------------------------------------------
    async def put_bytes(self, hashes: Sequence[bytes], data: bytes, tail_key: str = "", tail_lease_ms: int = 0,
                        request_id: str = "", chunk_bytes: int = 1024 * 1024) -> tuple[int, int, int]:
        """Blocks sent in the messages; returns (written, already present: their bytes kept,
        pending: another writer's, stored only once it commits)."""
        header = pb.PutBytesHeader(profile=self.profile_pb, block_hashes=hashes_to_pb(hashes), tail_key=tail_key,
                                   tail_lease_ms=tail_lease_ms, request_id=request_id)

        def messages():
            yield pb.PutBytesRequest(header=header)
            view = memoryview(data)
            for i in range(0, len(data), chunk_bytes):
                yield pb.PutBytesRequest(data=bytes(view[i : i + chunk_bytes]))

        stub = await self._stub_ready()
        resp = await stub.PutBytes(messages(), timeout=self.timeout_s, metadata=self._metadata)
        return resp.written, resp.already_present, resp.pending

    async def get_bytes(self, hashes: Sequence[bytes], tail_key: str = "",
                        request_id: str = "") -> tuple[int, bool, bytes]:
        """(blocks incl. the tail, has_tail, their bytes in order). The store verifies them before
        sending; one that fails ends the call with DATA_LOSS."""
        stub = await self._stub_ready()
        call = stub.GetBytes(pb.GetBytesRequest(profile=self.profile_pb, block_hashes=hashes_to_pb(hashes),
                                                tail_key=tail_key, request_id=request_id),
                             timeout=self.timeout_s, metadata=self._metadata)
        head = None
        parts = []
        async for msg in call:
            if head is None:
                head = msg
            else:
                parts.append(msg.data)
        return head.num_blocks, head.has_tail, b"".join(parts)

    async def stats(self) -> StoreStats:
        return stats_from_pb(await self._call("Stats", pb.StatsRequest()))

