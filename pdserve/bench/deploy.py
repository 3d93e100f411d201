"""Start a whole deployment for a benchmark: Redis (existing or our own), store, workers, router."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.runtime.launch import MooncakeMaster, RedisServer, ServiceProcess, free_port, redis_reachable
from pdserve.runtime.service import parse_cpus, pin_cpus, set_affinity
from services.kvstore.cluster import segment_bytes_holding


@dataclass
class DeploySpec:
    mode: str = "disagg"  # "disagg": P pool + D pool; "colocated": decode workers prefill for themselves
    policy: str = "cache_aware"
    engine: str = "real"  # or "mock"
    prefill: int = 1
    decode: int = 1
    worker_cache_tokens: int = 65536  # KV pages per worker, in tokens (bounds each worker's prefix cache)
    decode_kv_tokens: int = 65536  # disagg: KV pages per decode worker, in tokens (room for running requests)
    store_cache_tokens: int = 262144  # store device + DRAM capacity, in tokens
    block_size: int = 16
    block_nbytes: int = 65536  # tiny model KV per block (fp32, block 16)
    threads: int = 1
    # Give workers CPUs of their own (taskset-style): disagg, the CPUs split between the prefill
    # and decode pools in proportion to their sizes (one each on a two-CPU machine); colocated,
    # worker i on CPU i (mod the count). The store, the router and the client are not pinned.
    pin: bool = False
    # The router on these CPUs of its own (taskset-style), as a front door on a host of its own:
    # the store and the workers run on the others (split as `pin` says when it is set), and the
    # bench's load generator joins the router (Deployment.pin_client).
    router_cpus: str = ""
    extra_router_flags: tuple[str, ...] = ()
    extra_worker_flags: tuple[str, ...] = ()
    # Store nodes (node-0 ...), store_cache_tokens split evenly over them; workers spread over them
    # in turn. With cluster_segment_tokens, a mooncake_master and a cluster tier below every
    # node's DRAM, to which each node lends a segment that holds that many tokens (its objects are
    # larger than blocks, and the master evicts before a segment is full: cluster.py).
    store_nodes: int = 1
    cluster_segment_tokens: int = 0


def worker_cpus(mode: str, prefill: int, decode: int, cpus: list[int]) -> dict[tuple[str, int], str]:
    """{(role, index): '--cpus' value}: see DeploySpec.pin."""
    if mode == "colocated":
        return {("decode", i): str(cpus[i % len(cpus)]) for i in range(prefill + decode)}
    if len(cpus) < 2:
        raise ValueError("pinning a disaggregated deployment needs two CPUs or more")
    half = min(len(cpus) - 1, max(1, len(cpus) * prefill // (prefill + decode)))
    p_cpus, d_cpus = ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))
    return {**{("prefill", i): p_cpus for i in range(prefill)}, **{("decode", i): d_cpus for i in range(decode)}}


@dataclass
class Deployment:
    spec: DeploySpec
    redis_url: str
    key_prefix: str = field(default_factory=lambda: f"pdbench-{uuid.uuid4().hex[:8]}")
    procs: list[ServiceProcess] = field(default_factory=list)
    router: ServiceProcess | None = None
    metrics_port: int = 0  # the router's /metrics
    stores: list[str] = field(default_factory=list)  # each store node's address
    master: MooncakeMaster | None = None
    _own_redis: RedisServer | None = None

    @classmethod
    def start(cls, spec: DeploySpec) -> Deployment:
        url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        own = None
        if not redis_reachable(url):
            own = RedisServer().start()
            url = own.url
        d = cls(spec, url, _own_redis=own)
        try:
            d._start()
        except BaseException:
            d.stop()
            raise
        return d

    def _start(self) -> None:
        s = self.spec
        rest = sorted(os.sched_getaffinity(0) - parse_cpus(s.router_cpus))
        if s.router_cpus and not rest:
            raise ValueError(f"router_cpus {s.router_cpus!r} leaves no CPU for the store and the workers")
        elsewhere = ("--cpus", ",".join(map(str, rest))) if s.router_cpus else ()
        common = ["--model", "tiny", "--block-size", str(s.block_size), "--key-prefix", self.key_prefix,
                  "--engine", s.engine]
        env = {"PDSERVE_REDIS_URL": self.redis_url}  # (by environment: a flag would show its password in `ps`)
        cluster: list[str] = []
        if s.cluster_segment_tokens:
            self.master = MooncakeMaster().start()
            cluster = ["--cluster-store", "mooncake", "--cluster-master", self.master.address,
                       "--cluster-segment-bytes",
                       str(segment_bytes_holding(s.cluster_segment_tokens // s.block_size, s.block_nbytes))]
        store_blocks = max(16, s.store_cache_tokens // s.store_nodes // s.block_size)
        device = store_blocks // 4
        stores = [self._add(ServiceProcess(
            "services.kvstore", *common, "--device-bytes", str(device * s.block_nbytes),
            "--dram-bytes", str((store_blocks - device) * s.block_nbytes), *cluster, *elsewhere,
            *(("--node", f"node-{n}") if s.store_nodes > 1 else ()), env=env, name=f"kvstore-{n}"))
            for n in range(s.store_nodes)]
        for store in stores:
            store.start()
        self.stores = [st.address for st in stores]
        worker = [*common, "--threads", str(s.threads), "--heartbeat-s", "0.5", *s.extra_worker_flags]
        cache = str(s.worker_cache_tokens // s.block_size)
        if s.mode == "disagg":
            roles = [("prefill", s.prefill, cache), ("decode", s.decode, str(s.decode_kv_tokens // s.block_size))]
        else:
            roles = [("decode", s.prefill + s.decode, cache)]
        placed = worker_cpus(s.mode, s.prefill, s.decode, rest) if s.pin else {}
        workers = [self._add(ServiceProcess(f"services.{role}", *worker, "--num-blocks", pages,
                                            "--store", stores[i % len(stores)].address,
                                            *(("--cpus", placed[role, i]) if placed else elsewhere),
                                            env=env, name=f"{role}-{i}"))
                   for role, n, pages in roles for i in range(n)]
        for w in workers:
            w.spawn()
        for w in workers:
            w.wait_ready()
        self.metrics_port = free_port()
        router = ["--store", stores[0].address, "--policy", s.policy, "--refresh-s", "0.2", "--metrics-port",
                  str(self.metrics_port), *s.extra_router_flags]
        if s.mode == "colocated":
            router += ["--colocate-below-tokens", str(1 << 30)]
        if s.router_cpus:
            router += ["--cpus", s.router_cpus]
        self.router = self._add(ServiceProcess("services.router", *common, *router, env=env))
        self.router.start()
        self._wait_pool(len(workers))

    def _add(self, p: ServiceProcess) -> ServiceProcess:
        self.procs.append(p)
        return p

    def _wait_pool(self, n: int, timeout_s: float = 60) -> None:
        from pdserve.client import Client

        with Client(self.router.address) as c:
            deadline = time.time() + timeout_s
            while sum(1 for w in c.status().workers if w.healthy) < n:
                if time.time() > deadline:
                    raise RuntimeError("workers did not become healthy")
                time.sleep(0.2)
        time.sleep(1.0)  # one heartbeat so the router sees every worker's load

    def router_metrics(self) -> list[tuple[str, float]]:
        """The router's /metrics samples, (name without `pdserve_`, value)."""
        import urllib.request

        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return [(name[len("pdserve_"):], float(value)) for name, _, value in
                (line.partition(" ") for line in body.splitlines() if line and not line.startswith("#"))]

    @staticmethod
    def gauges(samples: list[tuple[str, float]]) -> dict[str, float]:
        """The gauges among /metrics samples (the router's fitted TTFT coefficients among them)."""
        return {name: v for name, v in samples if "{" not in name and not name.endswith(("_count", "_sum", "_total"))}

    @staticmethod
    def histogram_quantiles(samples: list[tuple[str, float]], name: str) -> dict[str, float]:
        """A router histogram's p50 and p99 as its buckets bound them (the upper edge of the bucket
        the quantile falls in), and its mean; {} when it has no observations."""
        prefix = f"router_{name}_bucket{{le=\""
        buckets = [(float(n[len(prefix):-2]), v) for n, v in samples if n.startswith(prefix)]
        count = next((v for n, v in samples if n == f"router_{name}_count"), 0.0)
        if not count:
            return {}
        total = next(v for n, v in samples if n == f"router_{name}_sum")
        p50, p99 = (next(le for le, cum in buckets if cum >= q * count) for q in (0.5, 0.99))
        return {"p50_at_most": p50, "p99_at_most": p99, "mean": total / count, "n": count}

    def store_stats(self) -> list[dict]:
        """Each store node's hit and miss counts, its cluster tier's counters and the calls it took."""
        import asyncio
        from dataclasses import asdict

        from pdserve.engine.mock_runner import served_profile
        from pdserve.kvclient.store_client import StoreClient
        from pdserve.model.spec import describe

        profile = served_profile(describe("tiny"), self.spec.block_size, mock=self.spec.engine == "mock")

        async def one(address: str) -> dict:
            client = StoreClient(address, profile)
            try:
                st = await client.stats()
            finally:
                await client.close()
            return {"hits": st.hits, "misses": st.misses, "cluster": asdict(st.cluster) if st.cluster else None,
                    "calls": st.calls}

        async def every() -> list[dict]:
            return [await one(a) for a in self.stores]

        return asyncio.run(every())

    def cpus(self) -> dict[str, list[int]]:
        """The CPUs each service runs on (its main thread's), by name."""
        return {p.name: sorted(os.sched_getaffinity(p.proc.pid)) for p in self.procs
                if p.proc is not None and p.proc.poll() is None}

    @contextlib.contextmanager
    def pin_client(self) -> Iterator[None]:
        """This process (the load generator: every thread) on the router's CPUs meanwhile, when it
        has its own, so that neither waits for a CPU behind the store and the workers."""
        if not self.spec.router_cpus:
            yield
            return
        before = os.sched_getaffinity(0)
        pin_cpus(self.spec.router_cpus)
        try:
            yield
        finally:
            set_affinity(before)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.master:
            self.master.stop()
        if self._own_redis:
            self._own_redis.stop()
