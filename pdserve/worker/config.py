"""Configuration shared by prefill and decode workers (env PDSERVE_* or flags)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import field
from pdserve.engine.device import check_device_name
from pdserve.runtime.service import parse_cpus

KV_PATHS = ("auto", "direct", "staged")


@dataclass(frozen=True)
class WorkerConfig:
    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(0, "port (0: any free port)")
    advertise_host: str = field("", "host others reach this worker at (default: --host)")
    port_file: str = field("", "write the bound port here once serving")
    worker_id: str = field("", "id in the registry (default: role-host-port)")
    model: str = field("tiny", "'tiny' or a Hugging Face checkpoint directory")
    dtype: str = field("float32", "float32 | bfloat16")
    block_size: int = field(16, "tokens per KV block")
    num_blocks: int = field(4096, "KV pages")
    max_num_batched_tokens: int = field(2048, "per-step token budget (chunked prefill)")
    max_num_seqs: int = field(128, "running sequences at once")
    threads: int = field(0, "torch threads (0: torch's default)")
    cpus: str = field("", "CPU ids this worker runs on, taskset-style, e.g. '1' or '0-3,8' (default: all)")
    engine: str = field("real", "real | mock (cost-model timing, no model compute)")
    device: str = field("auto", "auto | cpu | cuda | cuda:N: where weights, KV pages and sampling live (auto: CUDA "
                                "when torch sees a GPU)")
    attention_backend: str = field("auto", "auto | kernel (C, CPU) | flash (CUDA) | torch (any device)")
    linear_weights: str = field("auto", "auto (plain for float32 where the C decode GEMM is built, else packed "
                                "where it pays) | packed (reordered once for oneDNN: CPU, float32 or bfloat16) | plain")
    kv_path: str = field("auto", "how the transfer engine reaches the KV pages: direct (their own memory), staged "
                                 "(through a registered host buffer), auto (direct for host pages, staged for GPU)")
    kv_staging_blocks: int = field(0, "staged KV path: host buffer size in blocks (0: four of the longest prompts)")
    mock_cost: str = field("", "mock engine cost model: JSON file or inline JSON (default: fitted to tiny here)")
    mock_scale: float = field(1.0, "multiply every mock cost by this (e.g. to mimic a larger model)")
    store: str = field("127.0.0.1:50051", "kvstore address")
    store_timeout_ms: int = field(5000, "deadline of each store call (a backstop: keepalive finds a hung store in "
                                        "seconds; a busy one may answer slowly)")
    lease_ms: int = field(10_000, "store lease length for this worker's reads and writes (renewed every third; a "
                                  "dead writer's blocks are free again within one)")
    tail_ttl_ms: int = field(30_000, "how long a request's handoff waits in the store for its decode: the "
                                         "partial last block, and the hold on its full blocks")
    offload_blocks: int = field(256, "prefill: staging pages for blocks its prefix cache evicts, on their way "
                                     "to the store (0: evicted blocks are dropped)")
    prefill_timeout_ms: int = field(4000, "decode: fail with UNAVAILABLE when prefill is silent this long")
    redis_url: str = field("redis://127.0.0.1:6379/0", "Redis for registration and the prefix index")
    key_prefix: str = field("pdserve", "prefix of every Redis key")
    heartbeat_s: float = field(1.0, "registration heartbeat period")
    te_host: str = field("127.0.0.1", "address the transfer engine listens on")
    te_protocol: str = field("tcp", "transfer engine protocol: tcp or rdma")
    grace_s: float = field(5.0, "drain period on SIGTERM")
    step_timeout_s: float = field(60.0, "an engine step running longer than this is stuck: the worker stops "
                                        "serving and exits non-zero for its supervisor to restart it")

    def __post_init__(self) -> None:
        if self.engine not in ("real", "mock"):
            raise ValueError(f"engine must be real or mock, got {self.engine!r}")
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "store_timeout_ms",
                     "lease_ms", "tail_ttl_ms", "prefill_timeout_ms", "step_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        parse_cpus(self.cpus)
        check_device_name(self.device)
        if self.kv_path not in KV_PATHS:
            raise ValueError(f"kv_path must be one of {', '.join(KV_PATHS)}, got {self.kv_path!r}")
        if self.kv_staging_blocks < 0:
            raise ValueError(f"kv_staging_blocks must be >= 0, got {self.kv_staging_blocks}")
        if self.offload_blocks < 0:
            raise ValueError(f"offload_blocks must be >= 0, got {self.offload_blocks}")
