"""A worker's registration in Redis: role, address, hash profile and load, kept alive by heartbeat.

The record is signed with the deployment's service token on every beat (`sig`, an HMAC-SHA256
over the worker id and every field: where prompts go, the load that steers them, and the
heartbeat time and TTL), so anyone who can write to Redis but lacks the token can neither point
the router at a worker of their own, nor edit a worker's load, nor write back an old record once
its heartbeat has lapsed (its worker gone, and its address perhaps someone else's).

Also publishes the worker's own prefix-cache contents (bounded by its pages) to the prefix index.
Redis down: the worker keeps serving and says so once, and tries again every RETRY_S, so that
once Redis answers (empty, after a restart) the record and the whole cache index are back within
a fraction of a second, not a heartbeat later. Any other failure of a beat is logged and the beat
tried again after a bounded backoff: the heartbeat never ends while the worker runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from pdserve import logs
from pdserve.cluster import REDIS_DOWN, connect, transaction
from pdserve.cluster.index_events import EventWriter, worker_owner
from pdserve.cluster.keys import HEARTBEAT_TTLS, WORKERS_TTL_S, RedisKeys
from pdserve.kv.layout import HashProfile
from pdserve.runtime.tasks import Backoff, bounded_close, cancel_and_wait

log = logs.get("registry")
RETRY_S = 0.2  # between tries while Redis does not answer


def profile_json(p: HashProfile) -> str:
    lay = p.layout
    return json.dumps({"model_fingerprint": p.model_fingerprint, "num_layers": lay.num_layers,
                       "num_kv_heads": lay.num_kv_heads, "block_size": lay.block_size, "head_dim": lay.head_dim,
                       "dtype": lay.dtype}, sort_keys=True)


CLOCK_SKEW_S = 2.0  # how far a reader's clock may be from the worker's, judging its heartbeat


def sign(token: str, worker_id: str, record: dict[str, str]) -> str:
    """The `sig` field of a registration: HMAC-SHA256 with the service token over the worker id
    and every other field of the record."""
    message = json.dumps([worker_id, sorted((k, v) for k, v in record.items() if k != "sig")]).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def signature_problem(token: str, worker_id: str, record: dict[str, str]) -> str:
    """Why a registration must not be trusted ('' when its signature holds and, by the reader's
    clock, its signed heartbeat is within its TTL, give or take CLOCK_SKEW_S)."""
    sig = record.get("sig", "")
    if not sig:
        return "registration is not signed (a worker without the deployment's service token)"
    if not hmac.compare_digest(sig.encode(), sign(token, worker_id, record).encode()):
        return "registration signature is wrong (signed with another service token, or altered)"
    try:
        age_s = time.time() - float(record["heartbeat"])
        ttl_s = int(record["ttl_ms"]) / 1000
    except (KeyError, ValueError):
        return "registration has no heartbeat time or TTL"
    if not -CLOCK_SKEW_S <= age_s <= ttl_s + CLOCK_SKEW_S:  # (false for NaN too)
        return "registration's signed heartbeat is past its TTL, or in the future (an old record written back?)"
    return ""


class Registration:
    """Owns this worker's keys in Redis."""

    def __init__(self, url: str, keys: RedisKeys, worker_id: str, role: str, address: str, profile: HashProfile,
                 load: Callable[[], dict], cached_hashes: Callable[[], list[bytes]] | None = None,
                 interval_s: float = 1.0, service_token: str = "", store_node: str = "local",
                 shown: dict[str, str] | None = None):
        self.redis = connect(url, 1.0)
        self.keys = keys
        self.worker_id = worker_id
        # `shown`: fields for `pdserve status` only (the device, the KV path); nothing routes by them.
        self.fields = {**(shown or {}), "role": role, "address": address, "profile": profile_json(profile),
                       "store_node": store_node}
        self.service_token = service_token
        self.load = load
        self.cached_hashes = cached_hashes
        self.interval_s = interval_s
        self.connected = False
        self._published: frozenset[bytes] | None = None  # None: write the whole set next beat
        self._events = EventWriter(keys, worker_owner(worker_id))
        self._warned = False
        self._backoff = Backoff()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def ttl_ms(self) -> int:
        """How long the record outlives the last beat (written into it, so routers know how
        long a missing record may just be Redis having lost it)."""
        return max(1000, int(self.interval_s * HEARTBEAT_TTLS * 1000))

    async def stop(self) -> None:
        """Leave on purpose: the cache index goes, and the record becomes a tombstone that routers
        read as "gone now" (a record that is merely missing gets a grace: Redis may have lost it)."""
        await cancel_and_wait(self._task)
        try:
            pipe = await transaction(self.redis)
            key = self.keys.worker(self.worker_id)
            pipe.delete(key, self.keys.worker_index(self.worker_id))
            now = str(time.time())
            tombstone = {"left": now, "heartbeat": now, "ttl_ms": str(self.ttl_ms)}
            if self.service_token:  # (signed like a beat: routers act on no other)
                tombstone["sig"] = sign(self.service_token, self.worker_id, tombstone)
            pipe.hset(key, mapping=tombstone)
            pipe.pexpire(key, self.ttl_ms)
            self._events.queue(pipe, reset=True)
            await pipe.execute()
        except REDIS_DOWN:
            pass
        await bounded_close(self.redis)

    async def beat(self) -> None:
        ttl_ms = self.ttl_ms
        now = time.time()
        # One transaction: a reader never sees the cache index half rewritten.
        pipe = await transaction(self.redis)
        key = self.keys.worker(self.worker_id)
        record = {**self.fields, "load": json.dumps(self.load()), "heartbeat": str(now), "ttl_ms": str(ttl_ms)}
        if self.service_token:
            record["sig"] = sign(self.service_token, self.worker_id, record)
        pipe.delete(key)  # (a tombstone an earlier run of this worker id left)
        pipe.hset(key, mapping=record)
        pipe.pexpire(key, ttl_ms)
        pipe.zadd(self.keys.workers(), {self.worker_id: now})
        pipe.expire(self.keys.workers(), WORKERS_TTL_S)
        if self.cached_hashes is None:
            await pipe.execute()
            return
        hashes = frozenset(self.cached_hashes())
        index = self.keys.worker_index(self.worker_id)
        if self._published is None:
            pipe.delete(index)  # first beat, or Redis came back: the whole set
            added, removed = hashes, frozenset()
        else:
            # Only what changed: a worker's cache holds thousands of blocks, and rewriting the set
            # each beat would stall Redis (and every router look-up queued behind it).
            added, removed = hashes - self._published, self._published - hashes
        if removed:
            pipe.srem(index, *(h.hex() for h in removed))
        if added:
            pipe.sadd(index, *(h.hex() for h in added))
        if self._published is None or added or removed:
            self._events.queue(pipe, reset=self._published is None, added=added, removed=removed)
        pipe.scard(index)
        pipe.pexpire(index, ttl_ms)
        results = await pipe.execute()
        # A set of another size than ours lapsed while this worker stalled, or Redis lost it: the
        # next beat writes the whole set again.
        self._published = hashes if results[-2] == len(hashes) else None

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
                if self._published is None and self.cached_hashes is not None:
                    await self.beat()  # the set diverged (Redis lost it): whole now, not a beat later
                if not self.connected:
                    log.info("registered in redis", worker=self.worker_id, role=self.fields["role"])
                self.connected = True
                self._warned = False
                self._backoff.succeeded()
            except REDIS_DOWN as e:
                if self.connected or not self._warned:
                    log.warning("redis unavailable: serving on without registration", error=str(e))
                    self._warned = True
                self.connected = False
                self._published = None  # republish the whole set once Redis is back
                await asyncio.sleep(min(self.interval_s, RETRY_S))
                continue
            except Exception:  # noqa: BLE001 - a heartbeat that ended would take the worker out of every pool
                log.exception("registration beat failed: trying again")
                self.connected = False
                self._published = None
                await asyncio.sleep(self._backoff.failed())
                continue
            await asyncio.sleep(self.interval_s)


async def read_registrations(redis: aioredis.Redis, keys: RedisKeys) -> list[tuple[str, dict[str, str]]]:
    """Every registered worker's id and record, tombstones ({"left": time}) included. An id whose
    record expired (its heartbeat lapsed) is left out and removed from the workers set, so the set
    never keeps a crashed worker. Raises what Redis raises when it cannot be reached."""
    ids = await redis.zrange(keys.workers(), 0, -1)
    pipe = redis.pipeline(transaction=False)
    for wid in ids:
        pipe.hgetall(keys.worker(wid.decode()))
    records = await pipe.execute()
    lapsed = [wid for wid, rec in zip(ids, records, strict=True) if not rec]
    if lapsed:
        # (A worker that re-registers between the read and this loses its id until its next
        # beat re-adds it; routers give a missing record a grace, so that costs nothing.)
        await redis.zrem(keys.workers(), *lapsed)
    return [(wid.decode(), {k.decode(): v.decode() for k, v in rec.items()})
            for wid, rec in zip(ids, records, strict=True) if rec]
