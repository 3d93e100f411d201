"""The router's view of the worker pool: registrations from Redis, confirmed by gRPC health checks.

A worker whose heartbeat lapses (its Redis hash expired) or whose health check fails stops
receiving work, and comes back once both are fine again. A worker whose registration is not
signed with the deployment's service token, or whose hash profile differs from the pool's, is
refused (no channel is ever opened to it), with the reason logged once and shown in Status.
"""

from __future__ import annotations

import asyncio
import json
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

log = logs.get("router.workers")


@dataclass
class WorkerView:
    worker_id: str
    role: str  # "prefill" | "decode"
    address: str
    signature: str = ""  # the registration's `sig`: a new one is judged afresh
    load: dict = field(default_factory=dict)
    healthy: bool = False
    registered: bool = True
    refused_reason: str = ""
    channel: grpc.aio.Channel | None = None
    stub: object = None
    health: object = None
    inflight: int = 0  # requests this router has on it now
    inflight_tokens: int = 0  # tokens to compute, of prompts this router sent it whose prefill has not returned
    inflight_blocks: int = 0  # decode: KV blocks this router's requests there reserve
    inflight_blocks_at_read: int = 0  # ...as they were when `load` was last read

    def free_blocks(self) -> int:
        """Decode: free KV blocks, the heartbeat's figure corrected by what this router has
        sent there, or seen end, since it read it (a heartbeat is up to a beat old)."""
        return int(self.load.get("free_kv_blocks", 0)) - (self.inflight_blocks - self.inflight_blocks_at_read)

    @property
    def usable(self) -> bool:
        return self.healthy and self.registered and not self.refused_reason


class WorkerPool:
    """Owns the router's worker views and their channels; refreshed by one background task."""

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
        self._task: asyncio.Task | None = None
        self._warned = False

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
        await self._read_registry()
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def _read_registry(self) -> None:
        try:
            records = await read_registrations(self.redis, self.keys)
        except REDIS_DOWN as e:
            if self.redis_ok or not self._warned:
                log.warning("redis unreachable: routing by load alone on the last known workers", error=str(e))
                self._warned = True
            self.redis_ok = False
            return
        if not self.redis_ok:
            log.info("redis reachable: cache-aware routing on")
        self.redis_ok, self._warned = True, False
        seen = set()
        for wid, rec in records:
            if rec.get("role") not in ("prefill", "decode"):
                continue
            seen.add(wid)
            view = self.workers.get(wid)
            if view is None or view.address != rec.get("address") or view.signature != rec.get("sig", ""):
                view = self.workers[wid] = self._new_view(wid, rec)
            view.registered = True
            if not view.refused_reason:  # (a refused record's fields are never read: it may be anything)
                view.load = json.loads(rec.get("load", "{}"))
            view.inflight_blocks_at_read = view.inflight_blocks
        for wid, view in self.workers.items():
            if wid not in seen:
                view.registered = False

    def _new_view(self, wid: str, rec: dict) -> WorkerView:
        view = WorkerView(wid, rec["role"], rec.get("address", ""), rec.get("sig", ""))
        if self.service_token:
            view.refused_reason = signature_problem(self.service_token, wid, rec)
        if not view.refused_reason and rec.get("profile") != self.profile_json:
            view.refused_reason = f"hash profile differs from the pool's: {rec.get('profile')} vs {self.profile_json}"
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
            resp = await view.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            healthy = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            healthy = False
        if healthy != view.healthy:
            log.info("worker health changed", worker=view.worker_id, healthy=healthy)
        view.healthy = healthy

    def mark_failed(self, view: WorkerView) -> None:
        """A call to the worker failed as unreachable: stop sending it work until health says otherwise."""
        view.healthy = False

