"""The router's in-memory mirror of the prefix index, against real Redis and the real index
writers (a worker's Registration, the store's RedisIndex): exact contents after adds, removals,
resets and gaps, the same answers as the Lua look-up, and Redis going away and coming back."""

from __future__ import annotations

import asyncio
import random
import time

import redis.asyncio as aioredis

from pdserve.cluster import connect
from pdserve.cluster.index_events import EventWriter, IndexEvent, worker_owner
from pdserve.cluster.index_mirror import IndexMirror, leading_runs
from pdserve.cluster.keys import INDEX_TTL_S, RedisKeys
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.registry import Registration
from pdserve.cluster.store_index import RedisIndex
from pdserve.kv.layout import HashProfile, KVLayout

PROFILE = HashProfile("f" * 64, KVLayout(4, 2, 16, 64, "float32"))


def _chain(tag: int, n: int) -> list[bytes]:
    return [tag.to_bytes(2, "big") + i.to_bytes(4, "big") + bytes(10) for i in range(n)]


def _registration(url: str, keys: RedisKeys, worker: str, cached: list[bytes], interval_s: float = 1.0) -> Registration:
    return Registration(url, keys, worker, "prefill", "127.0.0.1:1", PROFILE, lambda: {}, lambda: list(cached),
                        interval_s=interval_s)


async def _mirror(url: str, keys: RedisKeys) -> IndexMirror:
    mirror = IndexMirror(connect(url, 2.0), keys)
    await mirror.sync()
    return mirror


def test_mirror_follows_workers_and_the_store_exactly_and_answers_as_the_lua_lookup(shared_redis_url, key_prefix):
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    chain = _chain(1, 40)

    async def scenario():
        a_cached, b_cached = list(chain[:12]), list(chain[:3])
        a = _registration(shared_redis_url, keys, "a", a_cached)
        b = _registration(shared_redis_url, keys, "b", b_cached)
        store_contents: list[tuple[bytes, str]] = []
        store = RedisIndex(shared_redis_url, keys, lambda: list(store_contents))
        lua_client = connect(shared_redis_url, 2.0)
        lua = PrefixIndex(lua_client, keys)
        mirror = await _mirror(shared_redis_url, keys)  # before anything is written
        try:
            await a.beat()  # first beats: whole sets (reset events)
            await b.beat()
            store_contents[:] = [(h, "dram") for h in chain[12:30] + chain[:2]]
            await store.flush()  # first flush: a rebuild (reset event)
            assert await mirror.poll(0) == 3
            assert mirror.reloads == 3
            assert mirror.worker_hashes("a") == frozenset(chain[:12])
            assert mirror.worker_hashes("b") == frozenset(chain[:3])
            assert mirror.store_hashes() == frozenset(chain[12:30] + chain[:2])
            hits = mirror.lookup(chain, ["a", "b", "c"])
            assert (hits.worker_blocks, hits.store_blocks, hits.store_after) == (
                {"a": 12, "b": 3, "c": 0}, 2, {"a": 18, "b": 0, "c": 2})

            # Deltas: a evicts its tail and caches another chain; the store drops and gains blocks.
            other = _chain(2, 10)
            a_cached[:] = chain[:8] + other
            await a.beat()
            store.dropped(chain[29])
            store.dropped(chain[0])
            store.committed([chain[30]], ["device"])
            store.moved(chain[12], "device")
            await store.flush()
            assert await mirror.poll(0) == 2
            assert mirror.reloads == 3  # deltas, applied in place
            assert mirror.worker_hashes("a") == frozenset(chain[:8] + other)
            assert mirror.store_hashes() == frozenset(chain[12:29] + chain[1:2] + chain[30:31])

            # The same answers as the Lua look-up, for chains that start anywhere.
            rng = random.Random(7)
            chains = [chain, other, chain[:5], chain[8:], chain[12:35], [], *(
                rng.sample(chain, rng.randint(1, 40)) for _ in range(20))]
            for c in chains:
                want = await lua.lookup(c, ["a", "b", "c"])
                got = mirror.lookup(c, ["a", "b", "c"])
                assert (got.worker_blocks, got.store_blocks, got.store_after) == (
                    want.worker_blocks, want.store_blocks, want.store_after), c

            # A mirror that starts now (snapshot, then the stream) holds exactly the same.
            late = await _mirror(shared_redis_url, keys)
            await late.poll(0)  # re-applies the events after its snapshot point: no change
            assert late.worker_hashes("a") == mirror.worker_hashes("a")
            assert late.worker_hashes("b") == mirror.worker_hashes("b")
            assert late.store_hashes() == mirror.store_hashes()
            await late.stop()

            # A worker that stops deletes its index and says so: the mirror forgets it.
            await b.stop()
            assert await mirror.poll(0) == 1
            assert mirror.worker_hashes("b") == frozenset()
            assert mirror.lookup(chain, ["b"]).worker_blocks == {"b": 0}
        finally:
            await mirror.stop()
            await a.stop()
            await store.redis.delete(keys.store_index(), keys.index_events())
            await store.redis.aclose()
            await lua_client.aclose()

    asyncio.run(scenario())


def test_a_gap_in_an_owners_events_makes_the_mirror_reread_its_key(shared_redis_url, key_prefix):
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    chain = _chain(3, 6)

    async def scenario():
        r = connect(shared_redis_url, 2.0)
        writer = EventWriter(keys, worker_owner("w"))
        mirror = await _mirror(shared_redis_url, keys)
        try:
            pipe = r.pipeline(transaction=True)
            pipe.sadd(keys.worker_index("w"), *(h.hex() for h in chain[:4]))
            writer.queue(pipe, added=chain[:4])
            await pipe.execute()
            assert await mirror.poll(0) == 1
            assert mirror.worker_hashes("w") == frozenset(chain[:4]) and mirror.reloads == 0
            # An event the mirror never sees (numbered, but not in the stream), then the next one.
            await r.sadd(keys.worker_index("w"), chain[4].hex())
            writer._seq += 1
            pipe = r.pipeline(transaction=True)
            pipe.sadd(keys.worker_index("w"), chain[5].hex())
            writer.queue(pipe, added=chain[5:6])
            await pipe.execute()
            assert await mirror.poll(0) == 1
            assert mirror.reloads == 1
            assert mirror.worker_hashes("w") == frozenset(chain)  # the key, not just the event
        finally:
            await mirror.stop()
            await r.delete(keys.worker_index("w"), keys.index_events())
            await r.aclose()

    asyncio.run(scenario())


def test_mirror_answers_from_its_last_copy_while_redis_is_down_and_resyncs_when_it_returns(private_redis, key_prefix):
    keys = RedisKeys(key_prefix)
    chain = _chain(4, 8)

    async def wait_for(cond, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    async def scenario():
        cached = list(chain[:5])
        worker = _registration(private_redis.url, keys, "w", cached, interval_s=0.1)
        worker.start()  # its own heartbeat loop, which rides out Redis going away
        mirror = IndexMirror(aioredis.Redis.from_url(private_redis.url, socket_timeout=1.0,
                                                     socket_connect_timeout=0.5), keys, block_ms=100)
        mirror.start()
        try:
            await wait_for(lambda: mirror.tailing and mirror.worker_hashes("w") == frozenset(chain[:5]))
            private_redis.stop()
            await wait_for(lambda: not mirror.tailing)
            # Meanwhile look-ups are answered from the last copy, without Redis.
            assert mirror.live and mirror.lookup(chain, ["w"]).worker_blocks == {"w": 5}
            cached[:] = chain
            private_redis.start()  # empty: Redis kept nothing; the worker republishes its whole set
            await wait_for(lambda: mirror.tailing and mirror.worker_hashes("w") == frozenset(chain))
            assert mirror.lookup(chain, ["w"]).worker_blocks == {"w": 8}
        finally:
            await mirror.stop()
            await worker.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))  # (once it hung a whole suite run: now it fails instead)


def test_leading_runs_on_plain_sets():
    """Unit check of the look-up over in-memory sets (no Redis): worker runs stop at the first
    miss of a prefix-closed cache; the store's run after a worker's run is scanned from there."""
    chain = _chain(5, 10)
    hits = leading_runs(chain, {"x": set(chain[:4]), "y": set(), "z": set(chain)},
                        {"local": set(chain[:2] + chain[4:7])})
    assert hits.worker_blocks == {"x": 4, "y": 0, "z": 10}
    assert hits.store_blocks == 2
    assert hits.store_after == {"x": 3, "y": 2, "z": 0}
    assert leading_runs([], {"x": set(chain)}, {"local": set(chain)}).worker_blocks == {"x": 0}

    # Two nodes and the cluster: each worker continues in its own node's store, then the cluster.
    hits = leading_runs(chain, {"x": set(chain[:4]), "y": set(chain[:1])},
                        {"A": set(chain[4:6]), "B": set(chain[:3])}, {"x": "A", "y": "B"}, set(chain[6:9]))
    assert (hits.node_blocks, hits.store_blocks) == ({"A": 0, "B": 3}, 3)
    assert hits.store_after == {"x": 2, "y": 2}
    assert hits.cluster_after == {"x": 3, "y": 0}
    assert [hits.store_tokens_for(w, 16) for w in "xy"] == [6 * 16, 3 * 16]
    assert [hits.cluster_tokens_for(w, 16) for w in "xy"] == [3 * 16, 0]


def test_mirror_of_two_store_nodes_and_the_cluster_answers_as_the_lua_lookup(shared_redis_url, key_prefix):
    """Two store nodes' RedisIndex writers (each its own key) and their cluster-index changes
    (one shared SET, written from the cluster tier's threads): the mirror holds exactly what Redis
    holds, and answers every chain as the Lua look-up does."""
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    chain = _chain(3, 40)

    async def scenario():
        a_held = [(h, "dram") for h in chain[8:16]]
        b_held = [(h, "device") for h in chain[:4]]
        node_a = RedisIndex(shared_redis_url, keys, lambda: list(a_held), node="A")
        node_b = RedisIndex(shared_redis_url, keys, lambda: list(b_held), node="B")
        node_a.cluster_capacity_blocks, node_b.cluster_capacity_blocks = 20, 0  # (B only uses the cluster)
        w = _registration(shared_redis_url, keys, "w", list(chain[:8]))
        lua_client = connect(shared_redis_url, 2.0)
        lua = PrefixIndex(lua_client, keys)
        mirror = await _mirror(shared_redis_url, keys)
        nodes = {"w": "A", "v": "B"}
        try:
            await w.beat()
            node_a.cluster_stored(chain[16:30])
            node_b.cluster_stored(chain[4:10])
            await node_a.flush()
            await node_b.flush()
            node_a.cluster_missing([chain[25]])  # a read missed: the hint goes
            await node_a.flush()
            assert {bytes.fromhex(m.decode()) for m in await lua_client.zrange(keys.cluster_index(), 0, -1)} == set(
                chain[4:10] + chain[16:25] + chain[26:30])
            assert await lua_client.ttl(keys.cluster_index()) > 0
            await mirror.poll(0)
            assert mirror.store_hashes("A") == frozenset(chain[8:16])
            assert mirror.store_hashes("B") == frozenset(chain[:4])
            assert mirror.cluster_hashes() == frozenset(chain[4:10] + chain[16:25] + chain[26:30])
            want = await lua.lookup(chain, ["w", "v"], nodes)
            # w: its own 8, node A's 8 after them, the cluster's 9 after those; v: node B's 4, the cluster's 6.
            assert (want.worker_blocks, want.node_blocks, want.store_after, want.cluster_after) == (
                {"w": 8, "v": 0}, {"A": 0, "B": 4}, {"w": 8, "v": 4}, {"w": 9, "v": 6})
            rng = random.Random(11)
            for c in [chain, chain[4:], chain[16:], [], *(rng.sample(chain, rng.randint(1, 40)) for _ in range(20))]:
                want = await lua.lookup(c, ["w", "v"], nodes)
                got = mirror.lookup(c, ["w", "v"], nodes)
                assert (got.worker_blocks, got.node_blocks, got.store_after, got.cluster_after) == (
                    want.worker_blocks, want.node_blocks, want.store_after, want.cluster_after), c
            late = await _mirror(shared_redis_url, keys)
            assert late.cluster_hashes() == mirror.cluster_hashes()
            assert late.store_hashes("A") == mirror.store_hashes("A")
            await late.stop()

            # Past the segments' capacity (20 blocks) the oldest hints go, in Redis and in the
            # mirror alike (the trim's removals travel in the event); a read refreshes a hint.
            await asyncio.sleep(0.01)
            node_b.cluster_stored([chain[16]])  # B read chain[16]: no longer among the oldest
            await node_b.flush()
            await asyncio.sleep(0.01)
            node_a.cluster_stored(chain[30:36])  # 19 + 6 = 25 held: 5 must go
            await node_a.flush()
            want_held = set(chain[4:10] + chain[16:17] + chain[22:25] + chain[26:36])  # A's first, 17-21, oldest
            assert {bytes.fromhex(m.decode()) for m in await lua_client.zrange(keys.cluster_index(), 0, -1)} == (
                want_held)
            assert await mirror.poll(0) == 2 and mirror.cluster_hashes() == frozenset(want_held)
        finally:
            await mirror.stop()
            await w.stop()
            await lua_client.delete(keys.store_index("A"), keys.store_index("B"), keys.cluster_index(),
                                    keys.cluster_capacity(), keys.index_events())
            for n in (node_a, node_b):
                await n.redis.aclose()
            await lua_client.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 60))



def test_a_gone_nodes_cluster_capacity_stops_counting(shared_redis_url, key_prefix):
    """The cluster index is trimmed to what the live nodes' segments hold: a capacity entry not
    rewritten within the index TTL (its node gone, or renamed) is removed, not summed. Before,
    entries were never removed, and a departed node's segment kept hints of blocks long evicted."""
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    chain = _chain(5, 8)

    async def scenario():
        node = RedisIndex(shared_redis_url, keys, lambda: [], node="A")
        node.cluster_capacity_blocks = 5
        r = connect(shared_redis_url, 2.0)
        try:
            await r.hset(keys.cluster_capacity(), "gone", f"1000:{time.time() - INDEX_TTL_S - 5:.0f}")
            node.cluster_stored(chain)
            await node.flush()
            held = {bytes.fromhex(m.decode()) for m in await r.zrange(keys.cluster_index(), 0, -1)}
            return held, set(await r.hkeys(keys.cluster_capacity()))
        finally:
            await r.delete(keys.store_index("A"), keys.cluster_index(), keys.cluster_capacity(), keys.index_events())
            await node.redis.aclose()
            await r.aclose()

    held, nodes = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert held == set(chain[3:]) and nodes == {b"A"}  # A's 5 blocks: the newest five hints

def test_the_store_index_flush_writes_each_change_exactly_in_one_script(shared_redis_url, key_prefix):
    """A flush's changes go to Redis as one string per tier, unpacked by a script there: the
    index and the change event must come out as the plain HSET/HDEL would have left them,
    across the script's 2,000-key chunks."""
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    held = _chain(7, 4500)

    async def go():
        index = RedisIndex(shared_redis_url, keys, lambda: [])
        r = connect(shared_redis_url, 2.0)
        try:
            await index.flush()  # the first flush rebuilds (empty) and resets
            index.committed(held[:2500], ["device"] * 2500)
            index.committed(held[2500:], ["dram"] * 2000)
            index.committed([b"tail:req-1"], ["device"])  # a per-request tail: never indexed
            await index.flush()
            for h in held[:5]:
                index.dropped(h)
            for h in held[5:9]:
                index.moved(h, "dram")
            await index.flush()
            got = await r.hgetall(keys.store_index())
            want = {h.hex().encode(): b"dram" if i >= 2500 or 5 <= i < 9 else b"device"
                    for i, h in enumerate(held) if i >= 5}
            assert got == want
            events = [IndexEvent.parse(f) for _, f in await r.xrange(keys.index_events())]
            assert [(e.seq, e.reset, len(e.added), e.removed) for e in events] == [
                (1, True, 0, ()), (2, False, 4500, ()), (3, False, 4, tuple(held[:5]))]
            assert set(events[1].added) == set(held) and events[2].added == tuple(held[5:9])
        finally:
            await r.delete(keys.store_index(), keys.index_events())
            await r.aclose()
            await index.redis.aclose()

    asyncio.run(go())


def test_the_store_index_writes_each_blocks_latest_change_in_the_order_it_was_told(shared_redis_url, key_prefix):
    """A commit hands the index its keys and tiers, read at the flush; a move or drop told after it
    wins, and a block committed again after its drop is indexed again."""
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    a, b, c, d = _chain(8, 4)

    async def go():
        index = RedisIndex(shared_redis_url, keys, lambda: [])
        r = connect(shared_redis_url, 2.0)
        try:
            await index.flush()
            index.committed([a, b, c], ["device"] * 3)
            index.moved(a, "dram")  # the store moves the block, then tells of it
            index.dropped(b)
            index.dropped(c)
            index.committed([c], ["dram"])
            index.moved(d, "device")
            await index.flush()
            assert await r.hgetall(keys.store_index()) == {
                a.hex().encode(): b"dram", c.hex().encode(): b"dram", d.hex().encode(): b"device"}
        finally:
            await r.delete(keys.store_index(), keys.index_events())
            await r.aclose()
            await index.redis.aclose()

    asyncio.run(go())


def test_the_store_index_is_rebuilt_when_its_key_vanishes_while_redis_stays_up(shared_redis_url, key_prefix):
    """A flushed or deleted index (no connection error to tell of it) is noticed by the next flush
    and written whole by the one after; the stream and the index both carry a TTL."""
    keys = RedisKeys.for_url(shared_redis_url, key_prefix)
    held = _chain(9, 3)

    async def go():
        index = RedisIndex(shared_redis_url, keys, lambda: [(h, "device") for h in held])
        r = connect(shared_redis_url, 2.0)
        try:
            await index.flush()
            assert len(await r.hkeys(keys.store_index())) == 3
            await r.delete(keys.store_index())
            await index.flush()  # sees it gone
            await index.flush()  # rebuilds it, with a reset event for the mirrors
            assert {bytes.fromhex(k.decode()) for k in await r.hkeys(keys.store_index())} == set(held)
            events = [IndexEvent.parse(f) for _, f in await r.xrange(keys.index_events())]
            assert [e.reset for e in events] == [True, True]
            assert await r.ttl(keys.store_index()) > 0 and await r.ttl(keys.index_events()) > 0
        finally:
            await r.delete(keys.store_index(), keys.index_events())
            await r.aclose()
            await index.redis.aclose()

    asyncio.run(go())
