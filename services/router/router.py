"""The request path through the router: validate, route, dispatch, stream, account."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import grpc

from pdserve import logs
from pdserve.cluster import REDIS_DOWN, Redis
from pdserve.cluster.index_mirror import IndexMirror
from pdserve.cluster.prefix_index import PrefixHits, PrefixIndex
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import ResourceExhausted, status_for
from pdserve.kv.hashing import block_hashes
from pdserve.kv.layout import HashProfile
from pdserve.model.tokenizer import TextStream, Tokenizer
from pdserve.rpc.convert import profile_to_pb, sampling_to_pb
from pdserve.runtime import telemetry
from pdserve.v1 import common_pb2
from services.router.admission import AdmissionQueue, NoRoom, NoWorkers
from services.router.config import RouterConfig
from services.router.dispatch import DecodeAdmitted, DispatchError, Finished, FirstFromPrefill, colocated, disaggregated
from services.router.limits import RequestIds, RequestLimits
from services.router.metrics import Metrics
from services.router.policy import Coefficients, DecodeCandidate, Policy, PrefillCandidate, PrefillCost, over_slo
from services.router.recent import RecentRoutes
from services.router.route_types import RETRY_ON, Route, Summary, TokenOut, log_request
from services.router.stop_strings import StopStrings
from services.router.workers import WorkerPool, WorkerView

log = logs.get("router")
tracer = telemetry.tracer("pdserve.router")


class Router:
    """Stateless apart from caches: the pool view, learned coefficients, the round-robin cursor."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer, profile: HashProfile, max_model_len: int,
                 vocab_size: int, redis: Redis, pool: WorkerPool, metrics: Metrics, mirror: IndexMirror | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.profile = profile
        self.profile_pb = profile_to_pb(profile)
        self.limits = RequestLimits(cfg, tokenizer, max_model_len, vocab_size)
        self.active = RequestIds()
        self.admission = AdmissionQueue(cfg.max_queued, cfg.queue_timeout_s, metrics)
        self.index = PrefixIndex(redis, pool.keys)
        self.mirror = mirror  # the index in memory, when kept; Redis is asked while it is not live
        self.pool = pool
        self.policy, self.recent = Policy(cfg.policy), RecentRoutes(ttl_s=3.0)
        pool.on_forget += [self.policy.keep_only, self.recent.keep_only]  # (both keyed by worker id)
        self.coef = Coefficients()
        self.metrics = metrics

    # -- routing ---------------------------------------------------------------------------
    async def route(self, ids: list[int], hashes: list[bytes], params: SamplingParams,
                    exclude: set[str] | frozenset[str] = frozenset(), waited_ms: float = 0, slo: bool = True) -> Route:
        """`exclude`: workers not to choose (this request already failed there). `waited_ms`: how
        long it has waited for room already (the TTFT SLO counts it). slo=False: a request whose
        first token is out (a migration) is not refused under the TTFT SLO: it is streaming."""
        t0 = time.perf_counter()
        decodes = self.pool.usable("decode")
        prefills = [w for w in self.pool.usable("prefill") if w.worker_id not in exclude]
        decodes = [w for w in decodes if w.worker_id not in exclude]
        bs = self.profile.block_size
        need = -(-(len(ids) + params.max_tokens - 1) // bs)
        dcands = [DecodeCandidate(w.worker_id, w.free_blocks(), int(w.load.get("running_requests", 0)) + w.inflight)
                  for w in decodes]
        dchoice = self.policy.choose_decode(dcands, need)
        # A handoff stays on one store node: a prefill is paired with its own node's decode.
        node_decode = {node: self.policy.choose_decode([c for c, w in zip(dcands, decodes, strict=True)
                                                        if w.store_node == node], need)
                       for node in {w.store_node for w in decodes}}
        if dchoice is not None:
            prefills = [w for w in prefills if node_decode.get(w.store_node) is not None]
        largest = max((int(w.load.get("total_kv_blocks", 0)) for w in decodes), default=0)
        if dchoice is None and 0 < largest < need:  # it never will: refused now, never queued
            raise ResourceExhausted(f"no decode worker can admit {need} KV blocks: the largest holds {largest} in "
                                    "all; shorten the prompt or max_tokens")
        if not decodes:
            raise NoWorkers(f"no healthy decode worker ({len(self.pool.workers)} registered)")
        no_room = NoRoom(f"no decode worker can admit {need} KV blocks now ({len(decodes)} healthy)")
        if dchoice is None and not self.cfg.ttft_slo_ms:
            raise no_room
        views = {w.worker_id: w for w in (*prefills, *decodes)}  # (the pool may drop one during the look-up)
        t_lookup = time.perf_counter()
        hits = await self._lookup(hashes, {w.worker_id: w.store_node for w in prefills})
        self.metrics.observe("route_lookup_ms", (time.perf_counter() - t_lookup) * 1e3)
        loadable = {w.worker_id: hits.store_tokens_for(w.worker_id, bs) for w in prefills}  # Redis's view
        if self.policy.name == "cache_aware" and self.pool.redis_ok:
            for w in prefills:
                recent = self.recent.leading(w.worker_id, hashes)
                if recent > hits.worker_blocks.get(w.worker_id, 0):
                    hits.worker_blocks[w.worker_id] = recent
        if prefills:
            # Queue: the heartbeat's figure is up to a beat old; what this router sent since is certain.
            pcands = [PrefillCandidate(w.worker_id, max(int(w.load.get("queued_tokens", 0)), w.inflight_tokens),
                                       hits.worker_blocks.get(w.worker_id, 0) * bs, w.inflight, loadable[w.worker_id],
                                       max(int(w.load.get("running_requests", 0)), w.inflight_prefills),
                                       hits.cluster_tokens_for(w.worker_id, bs))
                      for w in prefills]
            choice = self.policy.choose_prefill(pcands, len(ids), hits.store_blocks * bs, self.coef)
        uncached = len(ids) - (choice.expected_local_tokens + choice.expected_store_tokens if prefills else 0)
        colocate = not prefills or uncached < self.cfg.colocate_below_tokens
        paired = node_decode.get(views[choice.worker_id].store_node) if prefills else None
        # Prefill is sent once decode admits: its time to admit lately is part of the TTFT. Its
        # handoffs' time to complete after the first token is not, but its stream waits for that.
        d = views[paired.worker_id] if paired is not None else None
        admit_ms, handoff_ms = (d.admit.estimate_ms(), d.handoff.estimate_ms()) if d else (0.0, 0.0)
        estimate_ms = choice.estimated_ttft_ms + admit_ms if prefills else 0.0
        # Over the SLO is refused at once, before any wait for decode room: waiting makes it later.
        expected_ms = estimate_ms + self.coef.miss_ms if prefills else 0.0  # (as estimates have come out)
        if slo and not colocate and (refusal := over_slo(expected_ms, waited_ms, self.cfg.ttft_slo_ms, handoff_ms)):
            raise ResourceExhausted(refusal)
        if dchoice is None:  # (with an SLO, after its check: a request over it is refused at once, not queued)
            if slo and self.cfg.ttft_slo_ms and not colocate:
                no_room.budget_s = (self.cfg.ttft_slo_ms - waited_ms - expected_ms - handoff_ms) / 1e3
            raise no_room
        if colocate:
            decode = views[dchoice.worker_id]
            return Route(None, decode, self.policy.name, 0, 0, 0.0, (time.perf_counter() - t0) * 1e3,
                         decode_blocks=need)
        prefill = views[choice.worker_id]
        decode = views[node_decode[prefill.store_node].worker_id]
        self.recent.add(choice.worker_id, hashes)
        return Route(prefill, decode, self.policy.name, choice.expected_local_tokens,
                     choice.expected_store_tokens, estimate_ms, (time.perf_counter() - t0) * 1e3,
                     choice.best_hit_tokens, need, choice.queue)

    async def admitted_route(self, ids: list[int], hashes: list[bytes], params: SamplingParams,
                             exclude: set[str], deadline: float, waited_ms: float = 0.0, slo: bool = True) -> Route:
        """`waited_ms`: how long the request had waited before (the TTFT SLO counts it)."""
        t0 = time.perf_counter()
        waited = lambda: waited_ms + (time.perf_counter() - t0) * 1e3  # noqa: E731
        return await self.admission.admit(lambda: self.route(ids, hashes, params, exclude, waited(), slo), deadline)

    def index_source(self) -> str:
        """Where the next look-up reads the prefix index: "mirror", "redis", or "" (not read)."""
        if not self.pool.redis_ok or self.policy.name != "cache_aware":
            return ""
        return "mirror" if self.mirror is not None and self.mirror.live else "redis"

    async def _lookup(self, hashes: list[bytes], prefill_nodes: dict[str, str]) -> PrefixHits:
        """`prefill_nodes`: each candidate prefill worker's store node."""
        prefill_ids = list(prefill_nodes)
        source = self.index_source()
        if not source:
            return PrefixHits({}, 0)  # load-only routing
        if source == "mirror":
            return self.mirror.lookup(hashes, prefill_ids, prefill_nodes)
        try:
            return await self.index.lookup(hashes, prefill_ids, prefill_nodes)
        except REDIS_DOWN:
            self.pool.redis_ok = False
            return PrefixHits({}, 0)

    # -- one request -----------------------------------------------------------------------
    async def generate(self, request_id: str, ids: list[int], params: SamplingParams,
                       client_deadline_s: float | None = None, stop: tuple[str, ...] = (),
                       waited_ms: float | None = None, on_client_gone=None) -> AsyncIterator[TokenOut | Summary]:
        """`client_deadline_s`: the seconds the client's own deadline leaves (None: it set none).
        `waited_ms`: how long the call waited before it reached this method (its TTFT SLO counts it;
        None: not known). `stop`: strings that end the request (finish STOP), never part of its text;
        `on_client_gone(f)`: calls f as the client goes (its id is then free, cleanup or not)."""
        request_id = request_id or uuid.uuid4().hex
        release = await self.active.claim(request_id, on_client_gone)
        summary, status, t0 = None, "OK", time.perf_counter()
        if waited_ms is not None:
            self.metrics.observe("before_handler_ms", waited_ms)
        try:
            async for item in self._generate(request_id, ids, params,
                                             self.cfg.deadline_s(len(ids), params.max_tokens, client_deadline_s),
                                             StopStrings(stop) if stop else None, waited_ms or 0.0):
                if isinstance(item, Summary):
                    summary = item
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            status = "CANCELLED"
            raise
        except Exception as e:
            status = status_for(e).name
            if status == "RESOURCE_EXHAUSTED" and summary is None:
                self.metrics.observe("refusal_ms", (time.perf_counter() - t0) * 1e3)
            raise
        finally:
            release()
            log_request(log, request_id, len(ids), summary, status)

    async def _generate(self, request_id: str, ids: list[int], params: SamplingParams, timeout_s: float,
                        stops: StopStrings | None, waited_ms: float) -> AsyncIterator[TokenOut | Summary]:
        """Route and dispatch, hiding what can be hidden from the client:
        - a prefill that fails before the first token reached it is tried again on another
          prefill worker with a fresh handoff (`prefill_retries` times);
        - a decode that dies or hangs mid-stream is replaced (`max_migrations` times): the
          request resumes on another decode worker from the prompt plus the tokens already
          streamed, re-prefilled (the prompt's blocks mostly from cache), and the stream goes on
          from the next index, with no gap and no repeat."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        text = TextStream(self.tokenizer)
        out: list[int] = []  # the tokens the client has, in order
        failed: set[str] = set()  # workers this request already failed on
        retries = migrations = 0
        queued_ms = 0.0  # in the admission queue, over every attempt
        queue_until = time.monotonic() + self.cfg.queue_timeout_s  # a decode that refuses: wait for room this long
        last = ttft_ms = None
        for attempt in itertools.count():
            prompt = ids + out
            left = params if not out else replace(params, max_tokens=params.max_tokens - len(out))
            with tracer.start_as_current_span("route", attributes={"request_id": request_id,
                                                                   "prompt_tokens": len(prompt)}) as span:
                t_admit = time.perf_counter()
                route = await self.admitted_route(prompt, block_hashes(prompt, self.profile), left, failed, deadline,
                                                  waited_ms if attempt == 0 else 0.0, slo=not out)
                queued_ms += (time.perf_counter() - t_admit) * 1e3 - route.route_ms
                span.set_attribute("prefill", route.prefill.address if route.prefill else "")
                span.set_attribute("decode", route.decode.address)
                self.metrics.observe("route_ms", route.route_ms)
            summary = Summary(request_id, 0, route, len(ids), timings_ms={  # (ttft_ms: an earlier attempt's)
                "queue_ms": max(queued_ms, 0.0), **({"ttft_ms": ttft_ms} if ttft_ms is not None else {})})
            # A handoff of its own, unique on the workers and store: a reused id never meets old cleanup.
            handoff_id = f"{request_id}~{attempt}.{uuid.uuid4().hex[:8]}"
            try:
                async with aclosing(self._attempt(handoff_id, prompt, left, route, summary, deadline)) as items:
                    async for item in items:
                        now = time.perf_counter()
                        if last is None:
                            ttft_ms = summary.timings_ms["ttft_ms"] = (now - t0) * 1e3
                            self.metrics.observe("ttft_ms", ttft_ms)
                        else:
                            self.metrics.observe("itl_ms", (now - last) * 1e3)
                        last = now
                        piece, finish = text.push(item.token_id), item.finish_reason
                        if finish:
                            piece += text.flush()
                        if stops is not None:
                            piece, hit = stops.push(piece)
                            finish = common_pb2.FINISH_REASON_STOP if hit else finish
                            piece += stops.flush() if finish and not hit else ""
                        if finish:
                            summary.finish_reason = finish
                        yield TokenOut(item.token_id, piece, item.logprob, len(out), finish)
                        out.append(item.token_id)
                        if finish and finish != item.finish_reason:
                            break  # a stop string: closing the attempt cancels its calls
                break
            except DispatchError as e:
                if summary.finish_reason:
                    break  # answered in full: a failure after the last token is not the request's
                if not out and self._may_retry(e, "prefill", route.prefill, retries, self.cfg.prefill_retries,
                                               deadline):
                    retries += 1
                    failed.add(route.prefill.worker_id)
                    self.metrics.count("prefill_retries")
                    log.warning("prefill failed before the first token: trying another prefill worker", error=str(e),
                                request_id=request_id, prefill=route.prefill.worker_id, code=e.code.name)
                elif not out and e.side == "decode" and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and (
                        time.monotonic() < queue_until):
                    # Its admission is the truth our estimate missed: full until its next heartbeat.
                    route.decode.load["free_kv_blocks"] = 0
                    route.decode.inflight_blocks_at_read = route.decode.inflight_blocks
                    self.metrics.count("decode_admission_refused")
                elif out and self._may_retry(e, e.side, worker := {"prefill": route.prefill, "decode": route.decode}
                                             .get(e.side), migrations, self.cfg.max_migrations, deadline):
                    # Decode, or prefill's handoff after its first token was out: resume elsewhere.
                    migrations += 1
                    failed.add(worker.worker_id)
                    self.metrics.count("migrations")
                    log.warning(f"{e.side} failed mid-stream: migrating the request to another {e.side} worker",
                                request_id=request_id, worker=worker.worker_id, streamed=len(out),
                                code=e.code.name, error=str(e))
                else:
                    raise
        summary.completion_tokens = len(out)
        total = (time.perf_counter() - t0) * 1e3
        summary.timings_ms["total_ms"] = total
        if summary.completion_tokens > 1:
            tpot = (total - summary.timings_ms.get("ttft_ms", 0)) / (summary.completion_tokens - 1)
            summary.timings_ms["tpot_ms"] = tpot
            self.metrics.observe("tpot_ms", tpot)
        yield summary

    def _may_retry(self, e: DispatchError, side: str, worker: WorkerView | None, done: int, allowed: int,
                   deadline: float) -> bool:
        """Whether a failure on `side` may be hidden by trying again elsewhere: one that another
        worker might not have, with retries left, time left, and another worker to go to."""
        return (e.side == side and e.code in RETRY_ON and worker is not None and time.monotonic() < deadline
                and done < allowed and any(w.worker_id != worker.worker_id for w in self.pool.usable(side)))

    async def _attempt(self, request_id: str, ids: list[int], params: SamplingParams, route: Route,
                       summary: Summary, deadline: float):
        """One dispatch on one route, with what it adds to its workers' in-flight figures."""
        workers = [w for w in (route.prefill, route.decode) if w is not None]
        for w in workers:
            w.inflight += 1
        route.decode.inflight_blocks += route.decode_blocks
        prefill_pending = route.prefill is not None
        queued = route.queued_tokens(len(ids))
        if prefill_pending:
            route.prefill.count_prefill(queued, 1)
        try:
            async with aclosing(self._dispatch(request_id, ids, params, route, summary,
                                               max(deadline - time.monotonic(), 0.001))) as items:
                async for item in items:
                    if item.index == 0 and prefill_pending:
                        route.prefill.count_prefill(queued, -1)
                        prefill_pending = False
                    yield item
        except DispatchError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                for w in workers:
                    if e.side == w.role:
                        self.pool.mark_failed(w)
            raise
        finally:
            for w in workers:
                w.inflight -= 1
            route.decode.inflight_blocks -= route.decode_blocks
            if prefill_pending:
                route.prefill.count_prefill(queued, -1)
            self.admission.room_freed()

    async def _dispatch(self, request_id, ids, params, route: Route, summary: Summary, timeout_s: float):
        sampling = sampling_to_pb(params)
        if route.prefill is None:
            async with aclosing(colocated(route.decode.stub, request_id, ids, sampling, self.profile_pb, timeout_s,
                                          self.cfg.stream_interval)) as items:
                async for item in items:
                    if isinstance(item, Finished):
                        summary.cached_local = item.done.usage.cached_tokens_local
                    else:
                        summary.completion_tokens = item.index + 1
                        yield item
            summary.computed = len(ids) - summary.cached_local
            return
        t_sent = t_admitted = time.perf_counter()
        d = route.decode
        tickets = {d.admit: d.admit.start()}  # the stages of decode's this request is in, timed
        try:
            async with aclosing(disaggregated(route.prefill.stub, d.stub, request_id, ids, sampling, self.profile_pb,
                                              timeout_s, self.cfg.stream_interval,
                                              lambda: d.handoff.done(tickets.get(d.handoff, -1)))) as events:
                async for ev in events:
                    if isinstance(ev, DecodeAdmitted):
                        d.admit.done(tickets[d.admit])
                        t_admitted = ev.at
                        summary.timings_ms["decode_admit_ms"] = (ev.at - t_sent) * 1e3
                    elif isinstance(ev, FirstFromPrefill):
                        tickets[d.handoff] = d.handoff.start()
                        await self._account(ev.response, route, len(ids), (ev.at - t_admitted) * 1e3,
                                            (ev.at - t_sent) * 1e3)
                        u = ev.response.usage
                        summary.cached_local, summary.cached_store, summary.computed, summary.cached_cluster = (
                            u.cached_tokens_local, u.cached_tokens_store, u.computed_tokens, u.cached_tokens_cluster)
                        t = ev.response.timings
                        summary.timings_ms.update(load_ms=t.load_ms, prefill_ms=t.prefill_ms)
                        summary.completion_tokens = 1
                        yield ev.response.first_token
                    elif isinstance(ev, Finished):
                        summary.timings_ms.update(pull_wait_ms=ev.done.timings.pull_wait_ms,
                                                  store_write_ms=ev.handoff.store_write_ms)
                    else:
                        summary.completion_tokens = ev.index + 1
                        yield ev
        finally:
            for stage, ticket in tickets.items():
                stage.ended(ticket)

    async def _account(self, resp, route: Route, prompt_tokens: int, prefill_ms: float, first_token_ms: float) -> None:
        """`prefill_ms`: from decode's admission (prefill sent then) to prefill's first token, what the
        coefficients price; `first_token_ms`: from sending the request to decode to it, what the estimate priced."""
        u = resp.usage
        q = route.prefill_queue or PrefillCost(0, 0, 0)
        self.coef.missed(first_token_ms - route.estimated_ttft_ms)
        self.coef.observe(PrefillCost(q.requests + 1, q.tokens + u.computed_tokens,
                                      u.cached_tokens_store - u.cached_tokens_cluster, u.cached_tokens_cluster),
                          prefill_ms, resp.timings.load_ms)
        for name, n in (("prompt_tokens", prompt_tokens), ("hit_tokens_local", u.cached_tokens_local),
                        ("hit_tokens_store", u.cached_tokens_store), ("hit_tokens_cluster", u.cached_tokens_cluster)):
            self.metrics.count(name, n)
        if not self.pool.redis_ok:
            return
        try:
            await self.index.record(route.prefill.worker_id, prompt_tokens, route.expected_local_tokens,
                                    u.cached_tokens_local)
            await self.index.record("store", prompt_tokens, route.expected_store_tokens, u.cached_tokens_store)
            await self.index.record("all", prompt_tokens, route.expected_local_tokens + route.expected_store_tokens,
                                    u.cached_tokens_local + u.cached_tokens_store)
        except REDIS_DOWN:
            self.pool.redis_ok = False


