"""The router's view of the worker pool: registrations from Redis, confirmed by gRPC health checks.

Redis is advisory. A worker whose health check fails stops receiving work at once. A worker
whose record is missing from Redis keeps receiving work while its health check says SERVING, for
a grace of one heartbeat TTL (the one its last record gave) counted from when the record was
first seen missing or Redis last became readable again, whichever is later: Redis restarted
empty, or stalled, takes no worker out of the pool, and a worker that lost its registration for
good leaves when the grace ends (and Status with it). While Redis does not answer at all, the
last known pool stands. A worker that leaves on purpose leaves a tombstone, signed as its beats
are: out at once (an unsigned or stale one counts as a missing record).

A worker whose registration is not signed with the deployment's service token, or whose signed
heartbeat has lapsed (an old record written back), or whose hash profile differs from the pool's,
is refused (no channel is ever opened to it), with the reason logged once and shown in Status. A
worker in the pool whose record fails its signature later (edited, or an old one written back) is
not read from it: the record counts as missing, and the worker's next beat mends it. A worker is
registered anew when its role, address, profile or store node changes (its signature changes on
every beat).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import logs
from pdserve.cluster import REDIS_DOWN, Redis
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.registry import profile_json, read_registrations, signature_problem
from pdserve.kv.layout import HashProfile
from pdserve.runtime.server import channel
from pdserve.runtime.tasks import cancel_and_wait
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc
from services.router.stage_latency import StageLatency

log = logs.get("router.workers")
DEFAULT_GRACE_S = 3.0  # for a record that does not say its heartbeat TTL


@dataclass
class WorkerView:
    worker_id: str
    role: str  # "prefill" | "decode"
    address: str
    profile: str = ""  # its hash profile, as registered (JSON)
    store_node: str = "local"  # the store node it reads and writes KV through (a handoff stays on one node)
    shown: dict = field(default_factory=dict)  # its device and KV path, for Status only
    load: dict = field(default_factory=dict)
    healthy: bool = False
    checked: bool = False  # its health was asked at least once
    registered: bool = True  # its record is in Redis, or missing within the grace
    missing_since: float | None = None  # monotonic time its record was first seen missing
    grace_s: float = DEFAULT_GRACE_S  # its heartbeat TTL, from its last record
    refused_reason: str = ""
    channel: grpc.aio.Channel | None = None
    stub: object = None
    health: object = None
    inflight: int = 0  # requests this router has on it now
    inflight_tokens: int = 0  # tokens to compute, of prompts this router sent it whose prefill has not returned
    inflight_prefills: int = 0  # ...and how many prompts
    inflight_blocks: int = 0  # decode: KV blocks this router's requests there reserve
    inflight_blocks_at_read: int = 0  # ...as they were when `load` was last read
    admit: StageLatency = field(default_factory=StageLatency)  # decode: how long it takes to admit, lately
    handoff: StageLatency = field(default_factory=StageLatency)  # ...its handoffs to complete after the first token

    def free_blocks(self) -> int:
        """Decode: free KV blocks, the heartbeat's figure corrected by what this router has
        sent there, or seen end, since it read it (a heartbeat is up to a beat old)."""
        return int(self.load.get("free_kv_blocks", 0)) - (self.inflight_blocks - self.inflight_blocks_at_read)

    def count_prefill(self, tokens: int, n: int) -> None:
        """Prefill: `n` prompts (of `tokens` to compute) sent (n = 1) or returned (n = -1)."""
        self.inflight_tokens += tokens * n
        self.inflight_prefills += n

    @property
    def usable(self) -> bool:
        return self.healthy and self.registered and not self.refused_reason

    def same_registration(self, rec: dict[str, str]) -> bool:
        """Whether `rec` registers this worker as it is (else it registered anew)."""
        return ((self.role, self.address, self.profile, self.store_node)
                == (rec.get("role"), rec.get("address"), rec.get("profile"), rec.get("store_node") or "local"))


def _grace_s(rec: dict[str, str]) -> float:
    """How long the worker's record may be missing before it counts as gone: its heartbeat TTL."""
    try:
        ttl_s = int(rec.get("ttl_ms", "")) / 1000
    except ValueError:
        return DEFAULT_GRACE_S
    return min(max(ttl_s, 0.5), 60.0)


class WorkerPool:
    """Owns the router's worker views and their channels, and `redis_ok`; refreshed by one
    background task (the request path only reads them, and marks a worker failed)."""

    def __init__(self, redis: Redis, keys: RedisKeys, profile: HashProfile, refresh_s: float,
                 service_token: str = ""):
        """`service_token`: what registrations must be signed with ('' only when running --insecure:
        then any registration is trusted)."""
        self.redis = redis
        self.service_token = service_token
        self.keys = keys
        self.profile_json = profile_json(profile)
        self.refresh_s = refresh_s
        self.workers: dict[str, WorkerView] = {}
        self.redis_ok = False
        # When the registry last became readable after a read of it failed: a record missing since
        # before counts from then. (Only registry reads count: a request's look-up that failed sets
        # `redis_ok` false too, but must not restart every missing worker's grace.)
        self._readable_since = 0.0
        self._registry_read = False  # the last read of the registry succeeded
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # channels of workers that left, closing
        self._warned = False
        # Told the ids the pool still holds, each time it forgets a worker: what the router keeps
        # per worker (its recent routes, when each was last chosen) is pruned to them (an entry
        # that a request in flight adds for a worker just forgotten goes at the next).
        self.on_forget: list[Callable[[Collection[str]], None]] = []

    def usable(self, role: str) -> list[WorkerView]:
        return sorted((w for w in self.workers.values() if w.role == role and w.usable), key=lambda w: w.worker_id)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        for w in self.workers.values():
            if w.channel:
                await w.channel.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep routing with what we know
                log.exception("worker refresh failed")
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        # Health checks do not wait on Redis: a stalled Redis must not slow them.
        await asyncio.gather(self._read_registry(), *(self._check(w) for w in list(self.workers.values())))
        new = [w for w in self.workers.values() if not w.checked]
        await asyncio.gather(*(self._check(w) for w in new))  # (joined just now: usable at once)

    async def _read_registry(self) -> None:
        try:
            records = await read_registrations(self.redis, self.keys)
        except REDIS_DOWN as e:
            if self.redis_ok or not self._warned:
                log.warning("redis unreachable: routing by load alone on the last known workers", error=str(e))
                self._warned = True
            self.redis_ok = self._registry_read = False
            return
        now = time.monotonic()
        if not self.redis_ok:
            log.info("redis reachable: cache-aware routing on")
        if not self._registry_read:
            self._readable_since = now
        self.redis_ok, self._registry_read, self._warned = True, True, False
        seen = set()
        for wid, rec in records:
            untrusted = signature_problem(self.service_token, wid, rec) if self.service_token else ""
            if "left" in rec and wid in self.workers and not untrusted:  # a tombstone: it left on purpose
                self._forget(wid, "left")
                continue
            if rec.get("role") not in ("prefill", "decode"):  # (a forged tombstone too: read as missing)
                continue
            view = self.workers.get(wid)
            if untrusted and view is not None and not view.refused_reason:
                if view.missing_since is None:
                    log.warning("worker's registration not trusted: read as missing", worker=wid, reason=untrusted)
                continue
            seen.add(wid)
            problem = untrusted or self._profile_problem(rec)
            if view is None or not view.same_registration(rec) or (view.refused_reason and not problem):
                if view is not None:
                    self._forget(wid, "registered anew")
                view = self.workers[wid] = self._new_view(wid, rec, problem)
            view.registered, view.missing_since = True, None
            if not view.refused_reason:  # (a refused record's fields are never read: it may be anything)
                view.load = json.loads(rec.get("load", "{}"))
                view.inflight_blocks_at_read = view.inflight_blocks
                view.grace_s = _grace_s(rec)
        for wid, view in list(self.workers.items()):
            if wid in seen:
                continue
            if view.missing_since is None:
                view.missing_since = now
                log.info("worker's registration missing: kept while healthy for its grace", worker=wid,
                         grace_s=view.grace_s)
            if now - max(view.missing_since, self._readable_since) > view.grace_s:
                self._forget(wid, "registration lapsed")

    def _forget(self, wid: str, reason: str) -> None:
        """Out of the pool and of Status; its channel closes once the calls on it are done."""
        view = self.workers.pop(wid)
        view.registered = view.healthy = False
        log.info("worker left", worker=wid, address=view.address, reason=reason)
        for keep_only in self.on_forget:
            keep_only(self.workers.keys())
        if view.channel is not None:
            task = asyncio.get_running_loop().create_task(_close_when_idle(view))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _profile_problem(self, rec: dict[str, str]) -> str:
        if rec.get("profile") == self.profile_json:
            return ""
        return f"hash profile differs from the pool's: {rec.get('profile')} vs {self.profile_json}"

    def _new_view(self, wid: str, rec: dict, refused_reason: str) -> WorkerView:
        view = WorkerView(wid, rec["role"], rec.get("address", ""), rec.get("profile", ""),
                          rec.get("store_node") or "local", {k: rec.get(k, "") for k in ("device", "kv_path")},
                          refused_reason=refused_reason)
        if view.refused_reason:
            log.warning("worker refused", worker=wid, address=view.address, reason=view.refused_reason)
            return view
        view.channel = channel(view.address)
        cls = prefill_pb2_grpc.PrefillStub if view.role == "prefill" else decode_pb2_grpc.DecodeStub
        view.stub = cls(view.channel)
        view.health = health_pb2_grpc.HealthStub(view.channel)
        log.info("worker joined", worker=wid, role=view.role, address=view.address)
        return view

    async def _check(self, view: WorkerView) -> None:
        if view.health is None:
            return
        try:
            # Bounded here too: a call whose channel is closed under it (the worker left while its
            # check was in flight) can wait forever, and with it every later refresh.
            resp = await asyncio.wait_for(view.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0), 1.5)
            healthy = resp.status == health_pb2.HealthCheckResponse.SERVING
        except (grpc.aio.AioRpcError, TimeoutError, asyncio.CancelledError):
            if asyncio.current_task().cancelling():
                raise
            healthy = False
        if healthy != view.healthy:
            log.info("worker health changed", worker=view.worker_id, healthy=healthy)
        view.healthy, view.checked = healthy, True

    def mark_failed(self, view: WorkerView) -> None:
        """A call to the worker failed as unreachable: stop sending it work until health says otherwise."""
        view.healthy = False


async def _close_when_idle(view: WorkerView) -> None:
    """A departed worker's channel, closed once no request of this router's is on it (each is
    bounded by its deadline): closing it under them would cancel their calls, which grpc.aio ends
    with CancelledError rather than a status, so no retry or migration would follow."""
    while view.inflight:
        await asyncio.sleep(0.5)
    await view.channel.close()
