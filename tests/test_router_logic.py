"""Router logic above the I/O: routing with the index and the SLO, deadlines, this router's
recent-route memory. (Pure functions and a fake clock; the end-to-end router tests use real processes.)"""

from __future__ import annotations

import pytest

from pdserve.engine.sampling import SamplingParams
from services.router.policy import (
    Coefficients,
    Policy,
)
from services.router.recent import RecentRoutes


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recent_routes_leading_run_expiry_and_bound():
    clock = FakeClock()
    r = RecentRoutes(ttl_s=3.0, max_per_worker=4, clock=clock)
    r.add("p0", [b"a", b"b", b"c"])
    assert r.leading("p0", [b"a", b"b", b"x", b"c"]) == 2 and r.leading("p1", [b"a"]) == 0
    clock.now += 2.0
    r.add("p0", [b"a", b"d"])  # refreshes a; b, c keep their old time
    clock.now += 1.5
    assert r.leading("p0", [b"a", b"b"]) == 1  # b expired, a fresh
    r.add("p0", [b"e", b"f", b"g"])  # bound 4: the oldest go first
    assert r.leading("p0", [b"e", b"f", b"g"]) == 3 and r.leading("p0", [b"b"]) == 0


def test_recent_routes_binary_search_on_long_chains():
    clock = FakeClock()
    r = RecentRoutes(ttl_s=3.0, clock=clock)
    chain = [i.to_bytes(16, "big") for i in range(512)]
    r.add("p0", chain)
    assert [r.leading("p0", chain[:n]) for n in (0, 1, 2, 511, 512)] == [0, 1, 2, 511, 512]
    assert r.leading("p0", chain + [b"new"]) == 512
    clock.now += 2.0
    r.add("p0", chain[:100])  # a request sharing the first 100 blocks restamps exactly those
    clock.now += 1.5
    assert r.leading("p0", chain) == 100 and r.leading("p0", chain[:37]) == 37


def test_a_request_without_a_client_deadline_gets_one_sized_to_its_work():
    from services.router.config import RouterConfig

    cfg = RouterConfig()
    assert cfg.deadline_s(1000, 100, None) == 30 + 5 + 25
    assert cfg.deadline_s(1000, 100, 2.5) == 2.5  # the client's own
    assert cfg.deadline_s(1000, 100, -1.0) == 0.001  # already past


def test_prefix_lookup_counts_each_workers_run_and_the_store_run_after_it(shared_redis_url, key_prefix):
    """Real Redis, the router's Lua look-up: worker runs, the store's leading run, and the
    store's run right after each worker's run (a chain split between a cache and the store)."""
    import asyncio

    import redis as sync_redis
    import redis.asyncio as aioredis

    from pdserve.cluster.keys import RedisKeys
    from pdserve.cluster.prefix_index import PrefixIndex

    keys = RedisKeys(key_prefix)
    chain = [bytes([i]) * 16 for i in range(1, 41)]
    r = sync_redis.Redis.from_url(shared_redis_url)
    try:
        r.sadd(keys.worker_index("a"), *[h.hex() for h in chain[:12]])  # a: blocks 0-11
        r.sadd(keys.worker_index("b"), *[h.hex() for h in chain[:3]])  # b: 0-2
        # The store: blocks 12-29 (what a evicted, tail first), and 0-1.
        r.hset(keys.store_index(), mapping={h.hex(): "dram" for h in chain[12:30] + chain[:2]})

        async def lookup(hashes):
            client = aioredis.Redis.from_url(shared_redis_url)
            try:
                return await PrefixIndex(client, keys).lookup(hashes, ["a", "b", "c"])
            finally:
                await client.aclose()

        hits = asyncio.run(lookup(chain))
        assert hits.worker_blocks == {"a": 12, "b": 3, "c": 0}
        assert hits.store_blocks == 2
        assert hits.store_after == {"a": 18, "b": 0, "c": 2}
        assert [hits.store_tokens_for(w, 16) for w in "abc"] == [30 * 16, 3 * 16, 2 * 16]
        # Long runs cross the scan's batches (8, 16, ... 256 fields): exact at and past their edges.
        long = [i.to_bytes(2, "big") * 8 for i in range(1000, 1600)]
        r.hset(keys.store_index(), mapping={h.hex(): "dram" for h in long[:255] + long[256:600]})
        assert asyncio.run(lookup(long)).store_blocks == 255
        assert asyncio.run(lookup(long[:248])).store_blocks == 248
        assert asyncio.run(lookup(long[256:])).store_blocks == 344
    finally:
        r.delete(keys.worker_index("a"), keys.worker_index("b"), keys.store_index())


def test_a_routed_prompt_queues_only_the_tokens_it_computes():
    """The router's own queue figure for a worker must not count reused tokens as work: a worker
    that holds a popular prefix would look busy and lose the requests that reuse it."""
    from services.router.router import Route

    assert Route(None, None, "cache_aware", 700, 200, 0.0, 0.0).queued_tokens(1000) == 100
    assert Route(None, None, "cache_aware", 0, 0, 0.0, 0.0).queued_tokens(1000) == 1000
    assert Route(None, None, "cache_aware", 999, 0, 0.0, 0.0).queued_tokens(1000) == 1


def test_over_the_ttft_slo_is_refused_at_once_even_when_it_would_queue_for_decode_room():
    """With an SLO, a request whose estimate is over it is refused (RESOURCE_EXHAUSTED, with a
    retry hint) before it could queue for decode room; one under it queues (NoRoom); without an
    SLO, no room means queueing, as before. A fake pool and look-up, for the routing logic."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from pdserve.cluster.prefix_index import PrefixHits
    from pdserve.errors import ResourceExhausted
    from services.router.admission import NoRoom
    from services.router.config import RouterConfig
    from services.router.metrics import Metrics
    from services.router.router import Router
    from services.router.workers import WorkerView

    prefill = WorkerView("p0", "prefill", "unused", load={"queued_tokens": 0}, healthy=True)
    decode = WorkerView("d0", "decode", "unused", load={"free_kv_blocks": 0, "total_kv_blocks": 1000}, healthy=True)
    pool = SimpleNamespace(workers={"p0": prefill, "d0": decode}, redis_ok=False,
                           usable=lambda role: [w for w in (prefill, decode) if w.role == role])

    async def no_hits(hashes, ids):
        return PrefixHits({}, 0)

    def route(slo_ms: float, prompt_tokens: int, slo: bool = True):
        router = SimpleNamespace(cfg=RouterConfig(ttft_slo_ms=slo_ms), pool=pool, policy=Policy("cache_aware"),
                                 profile=SimpleNamespace(block_size=16), metrics=Metrics(), _lookup=no_hits,
                                 recent=RecentRoutes(ttl_s=3.0), coef=Coefficients(prefill_ms_per_token=0.1,
                                                                                   request_ms=5.0))
        return asyncio.run(Router.route(router, list(range(prompt_tokens)), [], SamplingParams(max_tokens=8),
                                        slo=slo))

    with pytest.raises(ResourceExhausted, match=r"estimated TTFT 205 ms exceeds the SLO 100 ms; retry in about 105"
                       ) as refused:
        route(100.0, 2000)
    assert not isinstance(refused.value, NoRoom)
    with pytest.raises(NoRoom) as migrating:  # a migration (its stream is under way) is not refused under it
        route(100.0, 2000, slo=False)
    assert migrating.value.budget_s == float("inf")
    with pytest.raises(NoRoom):
        route(100.0, 100)  # 15 ms: under the SLO, so it waits for room
    with pytest.raises(NoRoom):
        route(0.0, 2000)
    # Prefill is sent once decode admits, so the decode's time to admit lately is in the estimate:
    # the age of a request it still has not admitted, then the median of the last second's.
    from services.router.stage_latency import StageLatency

    now = [50.0]
    decode.admit = StageLatency(clock=lambda: now[0])
    decode.load["free_kv_blocks"] = 1000
    ticket = decode.admit.start()
    now[0] += 2.0
    with pytest.raises(ResourceExhausted, match=r"estimated TTFT 2015 ms exceeds the SLO 1000 ms"):
        route(1000.0, 100)
    decode.admit.done(ticket)
    with pytest.raises(ResourceExhausted, match=r"estimated TTFT 2015 ms exceeds the SLO 1000 ms"):
        route(1000.0, 100)
    now[0] += StageLatency.HORIZON_S + 0.001  # then it expires: nothing latches
    assert (route(1000.0, 100).decode, route(1000.0, 100).estimated_ttft_ms) == (decode, 15.0)
    # Its handoffs' time to complete after the first token is not in the TTFT estimate, but the
    # check counts it: the stream waits for it.
    decode.handoff = StageLatency(clock=lambda: now[0])
    ticket = decode.handoff.start()
    now[0] += 1.5
    with pytest.raises(ResourceExhausted, match=r"estimated TTFT 15 ms, then 1500 ms for its handoff to complete, "
                                                r"exceeds the SLO 1000 ms; retry in about 515"):
        route(1000.0, 100)
    decode.handoff.done(ticket)
    now[0] += StageLatency.HORIZON_S + 0.001
    assert route(1000.0, 100).estimated_ttft_ms == 15.0


def test_a_prefill_is_paired_with_a_decode_of_its_own_store_node():
    """Unit check of Router.route over a fake pool (logic only): the handoff stays on one store
    node, so the prefill chosen (here the one whose node's store holds the prompt) gets its own
    node's decode, though the other node's decode has more room; a node without decode room
    has its prefills left out."""
    import asyncio
    from types import SimpleNamespace

    from pdserve.cluster.prefix_index import PrefixHits
    from services.router.config import RouterConfig
    from services.router.metrics import Metrics
    from services.router.router import Router
    from services.router.workers import WorkerView

    def view(wid, role, node, free=0):
        return WorkerView(wid, role, "unused", store_node=node, healthy=True,
                          load={"queued_tokens": 0, "free_kv_blocks": free, "total_kv_blocks": 1000})

    workers = [view("pa", "prefill", "A"), view("pb", "prefill", "B"),
               view("da", "decode", "A", free=100), view("db", "decode", "B", free=900)]
    pool = SimpleNamespace(workers={w.worker_id: w for w in workers}, redis_ok=True,
                           usable=lambda role: [w for w in workers if w.role == role and w.free_blocks() >= 0])
    asked = []

    async def lookup(hashes, nodes):
        asked.append(dict(nodes))
        # Node A's store holds the whole prompt; B's nothing.
        return PrefixHits({w: 0 for w in nodes}, 63, {w: 63 if n == "A" else 0 for w, n in nodes.items()},
                          {"A": 63, "B": 0}, dict(nodes), {w: 0 for w in nodes})

    router = SimpleNamespace(cfg=RouterConfig(), pool=pool, policy=Policy("cache_aware"),
                             profile=SimpleNamespace(block_size=16), metrics=Metrics(), _lookup=lookup,
                             recent=RecentRoutes(ttl_s=3.0), coef=Coefficients())
    route = asyncio.run(Router.route(router, list(range(1024)), [], SamplingParams(max_tokens=8)))
    assert (route.prefill.worker_id, route.decode.worker_id) == ("pa", "da")
    assert asked == [{"pa": "A", "pb": "B"}]
    # Node A's decode full: A's prefill is not a candidate, B's pair serves it.
    workers[2].load["free_kv_blocks"] = 10
    route = asyncio.run(Router.route(router, list(range(1024)), [], SamplingParams(max_tokens=8)))
    assert (route.prefill.worker_id, route.decode.worker_id) == ("pb", "db")
    assert asked[-1] == {"pb": "B"}


def test_a_wait_longer_than_the_request_may_wait_is_refused_before_it_queues():
    """Logic test of AdmissionQueue alone (its `attempt` a fake with a room counter): with no
    admissions lately, a request that finds no room queues; once queued requests got room at a
    measured rate, one whose budget (its SLO's, or the queue timeout) is shorter than the queue
    ahead over that rate is refused at once (never queued, with the wait in its retry hint),
    and one with a longer budget queues."""
    import asyncio
    import math
    import time

    import pytest

    from pdserve.errors import ResourceExhausted
    from services.router.admission import AdmissionQueue, NoRoom
    from services.router.metrics import Metrics

    async def main():
        metrics = Metrics()
        q = AdmissionQueue(max_queued=100, timeout_s=2.0, metrics=metrics)
        room = 0

        def attempt(budget_s: float):
            async def once():
                nonlocal room
                if room:
                    room -= 1
                    return "admitted"
                e = NoRoom("no decode worker can admit 3 KV blocks now (1 healthy)")
                e.budget_s = budget_s
                raise e
            return once

        deadline = time.monotonic() + 60
        assert q.expected_wait_s() == 0.0
        first = asyncio.create_task(q.admit(attempt(0.01), deadline))  # no history: queues however short
        await asyncio.sleep(0.1)
        assert q.queued == 1
        room = 1
        q.room_freed()
        assert await first == "admitted"
        waiters = [asyncio.create_task(q.admit(attempt(math.inf), deadline)) for _ in range(12)]
        for _ in range(4):  # 4 of them get room over about 0.4 s
            await asyncio.sleep(0.1)
            room += 1
            q.room_freed()
        await asyncio.sleep(0.02)
        assert q.queued == 8 and room == 0
        wait_s = q.expected_wait_s()
        assert 0.3 < wait_s < 2.0, wait_s  # 9 places over about 5 admitted in about 0.5 s
        with pytest.raises(ResourceExhausted, match=r"queued for room it would wait about \d+ ms, longer than the "
                                                    r"100 ms its TTFT SLO leaves: retry in about") as refused:
            await q.admit(attempt(0.1), deadline)
        assert not isinstance(refused.value, NoRoom) and q.queued == 8
        assert metrics.counters["refused_expected_wait"] == 1
        late = asyncio.create_task(q.admit(attempt(30.0), deadline))  # within the 2 s queue timeout: it queues
        await asyncio.sleep(0.02)
        assert q.queued == 9
        room = 9
        q.room_freed()
        assert await asyncio.gather(late, *waiters) == ["admitted"] * 13
        assert q.queued == 0 and room == 0

    asyncio.run(main())


def test_stream_interval_is_bounded_as_decode_bounds_it():
    from pdserve.rpc.stream_interval import MAX_STREAM_INTERVAL
    from services.router.config import RouterConfig

    assert RouterConfig(stream_interval=MAX_STREAM_INTERVAL).stream_interval == 256
    for bad in (0, MAX_STREAM_INTERVAL + 1):
        with pytest.raises(ValueError, match=rf"stream_interval must be in \[1, 256\], got {bad}"):
            RouterConfig(stream_interval=bad)


def test_a_departed_workers_channel_closes_only_once_no_request_is_on_it():
    """Closed under a request, its call would be cancelled, which grpc.aio ends with CancelledError
    rather than a status: no retry, no migration, a stream cut short. Stand-ins for the view and
    its channel."""
    import asyncio
    from types import SimpleNamespace

    from services.router.workers import _close_when_idle

    closed = []

    class Channel:
        async def close(self, grace=None):
            closed.append(grace)

    view = SimpleNamespace(inflight=1, channel=Channel())

    async def go():
        task = asyncio.create_task(_close_when_idle(view))
        await asyncio.sleep(1.2)
        assert closed == [] and not task.done()
        view.inflight = 0
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert closed == [None]


def test_a_handoff_failing_after_decode_has_every_block_does_not_fail_the_request():
    """Decode streams tokens past the first only once it has read every block, so a prefill that
    fails after that (its last commit's answer lost, its process gone) is not the request's
    failure: the stream goes on. Before it has, the failure is the request's. Stand-ins for the
    two workers' gRPC calls."""
    import asyncio

    import grpc
    import pytest

    from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
    from services.router.dispatch import DispatchError, Finished, disaggregated

    gone = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")

    class Call:  # a streaming call: its messages in order, a number is a pause, an error is raised
        def __init__(self, *items):
            self.items = list(items)

        async def read(self):
            while self.items and isinstance(self.items[0], float):
                await asyncio.sleep(self.items.pop(0))
            if not self.items:
                return grpc.aio.EOF
            item = self.items.pop(0)
            if isinstance(item, Exception):
                raise item
            return item

        def cancel(self):
            pass

    def token(i, finish=common_pb2.FINISH_REASON_UNSPECIFIED):
        return decode_pb2.DecodeEvent(token=common_pb2.TokenEvent(token_id=10 + i, index=i, finish_reason=finish))

    first = prefill_pb2.PrefillEvent(first=prefill_pb2.PrefillResponse(first_token=common_pb2.TokenEvent(token_id=10)))

    def stubs(prefill_fails_after: float):
        done = decode_pb2.DecodeEvent(done=decode_pb2.DecodeDone())
        decode_call = Call(decode_pb2.DecodeEvent(admitted=decode_pb2.Admitted()), 0.05, token(1), 0.3, token(2),
                           token(3, common_pb2.FINISH_REASON_LENGTH), done)

        async def first_token(*a, **kw):
            return decode_pb2.FirstTokenResponse()

        decode = type("D", (), {"Generate": lambda self, *a, **kw: decode_call, "FirstToken": first_token})()
        prefill = type("P", (), {"Prefill": lambda self, *a, **kw: Call(first, prefill_fails_after, gone)})()
        return prefill, decode

    async def run(prefill_fails_after: float):
        prefill, decode = stubs(prefill_fails_after)
        return [ev async for ev in disaggregated(prefill, decode, "r", [1, 2, 3], common_pb2.SamplingParams())]

    events = asyncio.run(run(0.2))  # after decode's token 1: its outcome is moot
    assert [ev.index for ev in events if isinstance(ev, common_pb2.TokenEvent)] == [1, 2, 3]
    assert isinstance(events[-1], Finished)
    with pytest.raises(DispatchError) as err:  # before decode's token 1: the request's failure
        asyncio.run(run(0.01))
    assert err.value.side == "prefill" and err.value.code == grpc.StatusCode.UNAVAILABLE
