"""One decode request, end to end: admit (reserve pages or refuse at once), pull the prompt's blocks
from the store as prefill commits them, check them, continue from prefill's first token, stream.

Everything a request holds (pages, store pins, its in-flight entry) is released on every exit
path: finished, failed, cancelled, or prefill silent past the deadline.
"""

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
from pdserve.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from pdserve.model.tokenizer import TextStream
from pdserve.runtime import telemetry
from pdserve.runtime.server import cancel_for_call
from pdserve.worker.bootstrap import Worker
from pdserve.worker.engine_thread import Progress, next_event

log = logs.get("decode")
tracer = telemetry.tracer("pdserve.decode")


class CorruptKV(DataLoss):
    """A pulled block fails its writer's checksum: never decode from it."""


@dataclass(frozen=True)
class DecodeInput:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    colocated: bool
    tail_key: str
    prefill_timeout_s: float


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    logprob: float
    block_hashes: list[bytes]
    hold_lease_id: str = ""  # the store's hold on the prompt's blocks: released once they are pulled


@dataclass(frozen=True)
class Admitted:
    reserved_blocks: int
    local_hit_blocks: int


@dataclass(frozen=True)
class Token:
    event: TokenEvent
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_local: int
    timings_ms: dict[str, float]


@dataclass
class InFlight:
    first: asyncio.Future
    task: asyncio.Task | None
    colocated: bool = False  # prefilled here: no first token comes from a prefill worker
    last_activity: float = field(default_factory=time.monotonic)


class Decoder:
    """Owns this worker's in-flight decode requests."""

    def __init__(self, worker: Worker):
        self.w = worker
        self.inflight: dict[str, InFlight] = {}

    def deliver_first_token(self, request_id: str, first: FirstToken) -> None:
        entry = self.inflight.get(request_id)
        if entry is None or entry.colocated:
            raise NotFound(f"no request {request_id!r} is waiting for its first token here")
        if not entry.first.done():
            entry.first.set_result(first)
            entry.last_activity = time.monotonic()
        elif first.hold_lease_id and first.hold_lease_id != entry.first.result().hold_lease_id:
            self.w.store.release_soon(first.hold_lease_id)  # a second handoff's: nobody will pull it

    async def cancel(self, request_id: str) -> bool:
        entry = self.inflight.get(request_id)
        if entry is None or entry.task is None:
            return False
        cancel_for_call(entry.task)
        return True

    async def generate(self, req: DecodeInput) -> AsyncIterator[Admitted | Token | Done]:
        rid = req.request_id
        if rid in self.inflight:
            raise InvalidArgument(f"request {rid!r} is already decoding here")
        entry = self.inflight[rid] = InFlight(asyncio.get_running_loop().create_future(), asyncio.current_task(),
                                              req.colocated)
        stream = self.w.engine.open_stream(rid)
        live = True  # until the engine reports the request finished; abort is a no-op for unknown ids
        try:
            t0 = time.perf_counter()
            ahead: list[TokenEvent] = []  # the first token, when decode did not make it itself
            if req.colocated:
                await self.w.engine.call(lambda e: e.add_request(rid, req.prompt_ids, req.params))
                yield Admitted(0, 0)
                cached_local, pull_ms = 0, 0.0
            else:
                try:
                    res = await self.w.engine.call(lambda e: e.reserve(rid, req.prompt_ids, req.params))
                except OutOfPagesError as e:
                    raise ResourceExhausted(f"decode worker full: {e}; retry later") from e
                yield Admitted(len(res.block_table), res.num_cached_blocks)
                with tracer.start_as_current_span("decode.pull", attributes={"request_id": rid}) as span:
                    first, pull_ms = await self._pull_and_first(req, res, entry)
                    pulled = len(res.block_table) and (-(-len(req.prompt_ids) // self.w.cfg.block_size)
                                                       - res.num_cached_blocks)
                    span.set_attribute("bytes", pulled * self.w.store.block_nbytes)
                    span.set_attribute("local_hit_blocks", res.num_cached_blocks)
                cached_local = res.num_cached_blocks * self.w.cfg.block_size
                # Taken before the stream: the engine may have streamed the next token already.
                ahead.append(await self.w.engine.call(lambda e: e.activate(rid, first.token_id, first.logprob)))
            text = TextStream(self.w.model.tokenizer)
            # Not made current: it spans yields, and a generator closed from another context
            # cannot detach a context it attached (OpenTelemetry logs "Failed to detach context").
            span = tracer.start_span("decode", attributes={"request_id": rid})
            try:
                while True:
                    item = ahead.pop() if ahead else next_event(await stream.get())
                    if isinstance(item, Progress):
                        continue
                    if req.colocated and item.index == 0:  # (what its prefill here reused)
                        cached_local = min(item.cached_tokens, len(req.prompt_ids) - 1)
                    piece = text.push(item.token_id)
                    if item.finish_reason is not None:
                        piece += text.flush()
                    yield Token(item, piece)
                    if item.finish_reason is not None:
                        live = False
                        yield Done(item.finish_reason, len(req.prompt_ids), item.index + 1, cached_local,
                                   {"pull_wait_ms": pull_ms, "total_ms": (time.perf_counter() - t0) * 1e3})
                        return
            finally:
                span.end()
        finally:
            self.w.engine.close_stream(rid)
            self.inflight.pop(rid, None)
            if live:
                try:
                    await asyncio.shield(self.w.engine.call(lambda e: e.abort(rid)))
                finally:  # (a dead engine refuses the abort: the tail goes all the same)
                    if not req.colocated and len(req.prompt_ids) % self.w.cfg.block_size:
                        await asyncio.shield(self.drop_tail(req.tail_key or rid))

    async def drop_tail(self, tail_key: str) -> None:
        """A request that ends before its tail was pulled: consume the tail (read-once) so it does
        not sit pinned in the store until its TTL. Best effort: the TTL still bounds it."""
        try:
            pinned = await self.w.store.pin([], tail_key)
            if pinned.lease_id:
                await self.w.store.release(pinned.lease_id)
        except Exception:  # noqa: BLE001 - cleanup must not mask the request's own outcome
            pass

    async def _pull_and_first(self, req: DecodeInput, res, entry: InFlight) -> tuple[FirstToken, float]:
        """Pull every prompt block not cached here, and get the first token; watchdog on silence.
        Also the ms the pull went on after the first token arrived (the handoff's exposed cost)."""
        bs = self.w.cfg.block_size
        n_full = len(req.prompt_ids) // bs
        has_tail = len(req.prompt_ids) % bs != 0
        n_local = res.num_cached_blocks
        keys = res.prompt_hashes[n_local:n_full]
        pages = res.block_table[n_local : n_full + (1 if has_tail else 0)]
        tail_key = (req.tail_key or req.request_id) if has_tail else ""
        pull = asyncio.ensure_future(self._pull(req.request_id, keys, tail_key, pages, entry))
        first_at = None
        try:
            while True:
                if first_at is None and entry.first.done():
                    first_at = time.perf_counter()
                    # Checked at once: another prompt's blocks never come, and the wait would last the deadline.
                    if list(entry.first.result().block_hashes) != list(res.prompt_hashes):
                        raise InvalidArgument("prefill's block hashes do not match this request's prompt")
                if pull.done() and entry.first.done():
                    break
                # Woken by either, or when silence would pass the bound (any progress moves it).
                silent_for = time.monotonic() - entry.last_activity
                await asyncio.wait([t for t in (pull, entry.first) if not t.done()],
                                   timeout=max(req.prefill_timeout_s - silent_for, 0.0) + 0.001,
                                   return_when=asyncio.FIRST_COMPLETED)
                if pull.done() and pull.exception() is not None:
                    raise pull.exception()
                if time.monotonic() - entry.last_activity > req.prefill_timeout_s:
                    got = "first token" if entry.first.done() else "no first token"
                    raise Unavailable(f"prefill went silent: {got}, KV blocks incomplete after "
                                      f"{req.prefill_timeout_s:.1f}s; request {req.request_id!r} released")
        finally:
            if not pull.done():
                pull.cancel()
                await asyncio.gather(pull, return_exceptions=True)
            hold = entry.first.result().hold_lease_id if entry.first.done() else ""
            if hold:
                self.w.store.release_soon(hold)  # pulled, or never will be
        return entry.first.result(), (time.perf_counter() - first_at) * 1e3 if first_at is not None else 0.0

    async def _pull(self, rid: str, keys: list[bytes], tail_key: str, pages: list[int], entry: InFlight) -> None:
        if not pages:
            return
        store = self.w.store
        # The watch's lease pins what it delivered until the iteration ends, then goes with its stream.
        async with aclosing(store.watch(keys, tail_key, rid, self.w.cfg.lease_ms, timeout_s=24 * 3600)) as batches:
            async for batch in batches:
                # Verified off the engine thread: these pages are reserved and not yet decoded from.
                # (Staged: copied into the pages only when verified, on leaving the block.)
                async with self.w.pages.inbound([pages[i] for i in batch.indices]) as addrs:
                    bad = await store.read_slots(batch.slots, addrs)
                    if bad:
                        at = [batch.indices[i] for i in bad]
                        named = [keys[i] for i in at if i < len(keys)]
                        await asyncio.shield(store.report_corrupt(batch.lease_id, named, len(keys) in at))
                        raise CorruptKV(f"KV blocks {at[:5]} of request {rid!r} fail their checksum: dropped from "
                                        "the store; retry the request to recompute them")
                entry.last_activity = time.monotonic()
