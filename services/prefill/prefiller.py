"""One prefill request, end to end: cached prefix (own cache, then the store), compute the rest,
ship each full block to the store as soon as it exists (overlapping the next chunk's compute),
hand out the first token the moment it exists, then the partial tail under the request's key,
and report the handoff complete once the store has every commit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from pdserve import logs
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import OutOfPagesError
from pdserve.engine.sequence import FinishReason, TokenEvent
from pdserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from pdserve.kvclient.results import PENDING, WRITE, Allocation
from pdserve.runtime import telemetry
from pdserve.runtime.server import cancel_for_call
from pdserve.worker.bootstrap import Worker
from pdserve.worker.engine_thread import Progress, next_event

SETTLE_POLL_S = 0.05  # how often blocks another writer is putting are looked at again

log = logs.get("prefill")
tracer = telemetry.tracer("pdserve.prefill")


@dataclass(frozen=True)
class PrefillInput:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tail_key: str


@dataclass(frozen=True)
class PrefillOutput:
    request_id: str
    first_token: int
    first_logprob: float
    finish_reason: FinishReason | None
    block_hashes: list[bytes]
    tail_key: str
    kv_hold_lease_id: str  # the store's hold on the prompt's blocks, released by the decode that pulls them
    cached_local: int
    cached_store: int
    computed: int
    cached_cluster: int = 0  # of cached_store: fetched by the store from the cluster tier for this request
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HandoffDone:
    """Every block of the prompt is committed in the store (after the `PrefillOutput`)."""

    timings_ms: dict[str, float]


class Prefiller:
    """Owns this worker's in-flight prefill requests (request_id -> task)."""

    def __init__(self, worker: Worker):
        self.w = worker
        self.inflight: dict[str, asyncio.Task] = {}
        # What we put stays in our cache, and (offload on) comes back to the store when that cache
        # evicts it: the store treats it as a copy (evicted first, never sent to the cluster).
        self.keeps_copies = worker.cfg.offload_blocks > 0

    async def cancel(self, request_id: str) -> bool:
        task = self.inflight.get(request_id)
        if task is None:
            return False
        cancel_for_call(task)
        return True

    async def prefill(self, req: PrefillInput) -> AsyncIterator[PrefillOutput | HandoffDone]:
        """The first token (`PrefillOutput`) the moment it exists, then `HandoffDone`."""
        if req.request_id in self.inflight:
            raise InvalidArgument(f"request {req.request_id!r} is already being prefilled here")
        self.inflight[req.request_id] = asyncio.current_task()
        # Not made current: it spans yields (see services/decode/decoder.py).
        span = tracer.start_span("prefill", attributes={"request_id": req.request_id,
                                                        "prompt_tokens": len(req.prompt_ids)})
        try:
            # aclosing: the entry goes only once _prefill's own cleanup has run (a retry of the same
            # id arriving meanwhile would otherwise pass the check above, then lose its stream).
            async with aclosing(self._prefill(req)) as outs:
                async for out in outs:
                    yield out
        finally:
            span.end()
            self.inflight.pop(req.request_id, None)

    async def _prefill(self, req: PrefillInput) -> AsyncIterator[PrefillOutput | HandoffDone]:
        w, rid, bs = self.w, req.request_id, self.w.cfg.block_size
        t0 = time.perf_counter()
        stream = w.engine.open_stream(rid)
        alloc: Allocation | None = None
        hold = ""
        renewal: asyncio.Task | None = None
        try:
            try:
                res = await w.engine.call(lambda e: e.reserve(rid, req.prompt_ids, req.params))
            except OutOfPagesError as e:
                raise ResourceExhausted(f"prefill worker full: {e}; retry later") from e
            n_full = len(req.prompt_ids) // bs
            n_local = res.num_local_blocks
            t_reserved = time.perf_counter()
            n_store, n_cluster = await self._load_from_store(rid, res.prompt_hashes, res.block_table, n_local, n_full)
            await w.engine.call(lambda e: e.start_compute(rid, n_local + n_store))
            t_loaded = time.perf_counter()
            tail_key = (req.tail_key or rid) if len(req.prompt_ids) % bs else ""
            # Held for the decode until it has pulled them: a decode that starts reading late
            # must not find them evicted (handoff copies are the first to go once unpinned).
            alloc = await w.store.allocate(res.prompt_hashes, tail_key, rid, w.cfg.lease_ms,
                                           writer_keeps_copy=self.keeps_copies, hold_ms=w.cfg.tail_ttl_ms)
            hold = alloc.hold_lease_id
            renewal = w.store.keep_alive(alloc.lease_id, w.cfg.lease_ms)
            pages = res.block_table[: n_full + (1 if tail_key else 0)]
            shipped, write_s = 0, 0.0
            while True:
                item = next_event(await stream.get())
                if isinstance(item, Progress):
                    full = min(item.num_computed_tokens // bs, n_full)
                    if full > shipped:
                        write_s += await self._ship(alloc, pages, shipped, full)
                        shipped = full
                elif isinstance(item, TokenEvent):
                    first = item
                    break
            t_first = time.perf_counter()
            # The last blocks are written before the first token goes out (their commits are not
            # awaited): past the yield this runs on only once the token's message is sent, and
            # decode needs them.
            # A request that ends at its first token has no decode to read its tail: it goes at
            # the store's next reap rather than pinned for the tail's TTL.
            write_s += await self._ship(alloc, pages, shipped, len(pages),
                                        tail_ttl_ms=1 if first.finish_reason is not None else w.cfg.tail_ttl_ms)
            # The last prompt token is always computed; everything before it that was loaded is a hit.
            cached = min((n_local + n_store) * bs, len(req.prompt_ids) - 1)
            local = min(n_local * bs, cached)
            yield PrefillOutput(
                rid, first.token_id, first.logprob, first.finish_reason, list(res.prompt_hashes), tail_key, hold,
                cached_local=local, cached_store=cached - local, computed=len(req.prompt_ids) - cached,
                cached_cluster=min(n_cluster * bs, cached - local),
                timings_ms={"queue_ms": (t_reserved - t0) * 1e3, "load_ms": (t_loaded - t_reserved) * 1e3,
                            "prefill_ms": (t_first - t_loaded) * 1e3, "store_write_ms": write_s * 1e3,
                            "total_ms": (time.perf_counter() - t0) * 1e3})
            t_sent = time.perf_counter()
            await w.store.finish(alloc)  # every commit answered: refused ones fail the request
            await self._settle_pending(rid, alloc, pages)
            exposed_s = time.perf_counter() - t_sent
            alloc = None  # fully committed: the lease is closed
            if first.finish_reason is not None and hold:
                w.store.release_soon(hold)  # the request ended at its first token: no decode pulls
            await w.engine.call(lambda e: e.release(rid))
        except BaseException:
            # Abort even when `reserve` was still in flight as we were cancelled: the engine runs
            # commands in order, so this abort follows it (and is a no-op for unknown ids).
            try:
                await asyncio.shield(w.engine.call(lambda e: e.abort(rid)))
            finally:  # (a dead engine refuses the abort: the store's leases go all the same)
                if alloc is not None:  # (the store ends the hold with it while it is open)
                    await asyncio.shield(w.store._release_quietly(alloc.lease_id))
                if hold:  # (the write lease closes at its last commit: the hold outlives it)
                    await asyncio.shield(w.store._release_quietly(hold))
            raise
        finally:
            if renewal is not None:
                renewal.cancel()
            w.engine.close_stream(rid)
        write_s += exposed_s
        yield HandoffDone({"store_write_ms": write_s * 1e3, "store_write_exposed_ms": exposed_s * 1e3,
                           "total_ms": (time.perf_counter() - t0) * 1e3})

    async def _settle_pending(self, rid: str, alloc: Allocation, pages: list[int]) -> None:
        """Blocks another writer was putting when we allocated (PENDING) must be committed for
        our reader before it is told they are there. Wait for that writer; the blocks of one
        that gave up (or died: its lease lapsed) are put again here, from our own pages, which
        hold every block of this prompt until we release them."""
        pending = [i for i, state in enumerate(alloc.slots.states[: len(alloc.hashes)]) if state == PENDING]
        if not pending:
            return
        store, lease_ms = self.w.store, self.w.cfg.lease_ms
        give_up = time.monotonic() + 3 * lease_ms / 1000  # a live writer renews; a dead one lapses within one
        while True:
            again = await store.allocate([alloc.hashes[i] for i in pending], "", rid, lease_ms,
                                         writer_keeps_copy=self.keeps_copies)
            try:
                async with self.w.pages.outbound([pages[i] for i in pending]) as addrs:
                    await store.ship(again, 0, len(pending), addrs)
            except BaseException:
                if WRITE in again.slots.states:
                    await asyncio.shield(store._release_quietly(again.lease_id))
                raise
            pending = [i for i, state in zip(pending, again.slots.states, strict=True) if state == PENDING]
            if not pending:
                return
            if time.monotonic() > give_up:
                raise Unavailable(f"{len(pending)} KV blocks of request {rid!r} stayed in another writer's hands past "
                                  f"{3 * lease_ms} ms; retry the request")
            await asyncio.sleep(SETTLE_POLL_S)

    async def _load_from_store(self, rid: str, hashes: list[bytes], table: list[int], n_local: int,
                               loadable: int) -> tuple[int, int]:
        """Read the store's blocks [n_local, loadable) of the chain into our pages; how many were
        read, and how many of those the store fetched from the cluster tier."""
        if n_local >= loadable:
            return 0, 0
        store = self.w.store
        with tracer.start_as_current_span("store.get", attributes={"request_id": rid}) as span:
            pinned = await store.pin(hashes[n_local:loadable], request_id=rid, lease_ms=self.w.cfg.lease_ms)
            if not pinned.lease_id:
                return 0, 0
            try:
                n = len(pinned.slots)
                async with self.w.pages.inbound(table[n_local : n_local + n]) as addrs:
                    bad = await store.read_slots(pinned.slots, addrs)
                if bad:  # never computed from: the prefix ends before the first, the rest is recomputed
                    await store.report_corrupt(pinned.lease_id, [hashes[n_local + i] for i in bad])
                    n = bad[0]
                    span.set_attribute("corrupt_blocks", len(bad))
            finally:
                store.release_soon(pinned.lease_id)
            span.set_attribute("blocks", n)
            span.set_attribute("bytes", n * store.block_nbytes)
            return n, max(0, n - (len(pinned.slots) - pinned.from_cluster))

    async def _ship(self, alloc: Allocation, pages: list[int], start: int, end: int, tail_ttl_ms: int = 0) -> float:
        """Write blocks [start, end) where the store asked for them and send their commit (its
        answer is awaited once, at the end: the decode's Watch is what waits on it)."""
        if end <= start:
            return 0.0
        t0 = time.perf_counter()
        store = self.w.store
        with tracer.start_as_current_span("store.put", attributes={"blocks": end - start}) as span:
            async with self.w.pages.outbound(pages[start:end]) as addrs:
                slices = await store.ship(alloc, start, end, addrs, tail_ttl_ms=tail_ttl_ms, wait=False)
            elapsed = time.perf_counter() - t0
            written = alloc.slots[start:end].states.count(WRITE)
            moved = written * store.block_nbytes
            span.set_attribute("bytes", moved)
            span.set_attribute("slices", slices)
            span.set_attribute("gbps", moved / elapsed / 1e9 if elapsed > 0 else 0.0)
        return elapsed
