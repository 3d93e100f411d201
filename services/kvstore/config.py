"""kvstore configuration (env PDSERVE_* or flags)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import field
from pdserve.runtime.service import parse_cpus

MIB = 1024 * 1024


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(0, "port (0: any free port)")
    unix: bool = field(True, "also serve gRPC at an abstract Unix socket, for clients on this host and network "
                             "namespace (Linux): a shorter round trip than TCP loopback")
    port_file: str = field("", "write the bound port here once serving")
    node: str = field("local", "this store node's name, unique in the deployment: its workers register it, the "
                               "router pairs a prefill with a decode of the same node, the prefix index is per node")
    model: str = field("tiny", "model whose KV this store serves: 'tiny' or a checkpoint directory")
    dtype: str = field("float32", "KV dtype")
    engine: str = field("real", "real | mock: the workers' engine (mock KV has its own profile)")
    block_size: int = field(16, "tokens per block")
    kv_layout: str = field("", "explicit layout 'layers,kv_heads,block_size,head_dim,dtype' (with --model-fingerprint)")
    model_fingerprint: str = field("", "fingerprint for an explicit --kv-layout")
    device_bytes: int = field(256 * MIB, "device tier capacity in bytes")
    dram_bytes: int = field(1024 * MIB, "DRAM tier capacity in bytes")
    lease_ms: int = field(10_000, "default lease length")
    max_lease_ms: int = field(300_000, "longest lease, hold or tail TTL one call may ask for (holders renew)")
    max_leases_per_client: int = field(4096, "open leases one client may hold at once")
    fence_ms: int = field(30_000, "how long the slots of a write lease that ended uncommitted stay quarantined "
                                  "before reuse (a writer still moving bytes into them must have stopped by then)")
    max_blocks_per_request: int = field(16_384, "hard cap on blocks named by one request")
    redis_url: str = field("redis://127.0.0.1:6379/0", "Redis for the prefix index and hit counters")
    key_prefix: str = field("pdserve", "prefix of every Redis key")
    te_host: str = field("127.0.0.1", "address the transfer engine listens on")
    te_protocol: str = field("tcp", "transfer engine protocol: tcp or rdma")
    cluster_store: str = field("", "a cluster tier below DRAM shared by every store node: '' (none) or 'mooncake'")
    cluster_master: str = field("127.0.0.1:50051", "mooncake_master's host:port (with --cluster-store mooncake)")
    cluster_metadata: str = field("P2PHANDSHAKE", "the cluster's metadata server: P2PHANDSHAKE or a URL")
    cluster_protocol: str = field("tcp", "the cluster's transfer protocol: tcp or rdma")
    cluster_segment_bytes: int = field(0, "memory this node gives the cluster (0: it only uses the cluster)")
    cluster_buffer_bytes: int = field(64 * MIB, "staging buffer for blocks moving to and from the cluster")
    cluster_timeout_ms: int = field(2000, "longest a get waits on a cluster fetch before it answers a miss")
    grace_s: float = field(5.0, "drain period on SIGTERM")
    cpus: str = field("", "CPU ids the store runs on, taskset-style, e.g. '0' or '0-3' (default: all)")

    def __post_init__(self) -> None:
        if self.device_bytes <= 0 or self.dram_bytes <= 0:
            raise ValueError("device_bytes and dram_bytes must be positive")
        if bool(self.kv_layout) != bool(self.model_fingerprint):
            raise ValueError("--kv-layout and --model-fingerprint go together")
        if not 0 < self.lease_ms <= self.max_lease_ms:
            raise ValueError("lease_ms must be positive and at most max_lease_ms")
        if self.max_leases_per_client <= 0:
            raise ValueError("max_leases_per_client must be positive")
        if self.fence_ms < 0:
            raise ValueError("fence_ms must not be negative")
        if self.cluster_store not in ("", "mooncake"):
            raise ValueError(f"cluster_store must be '' or 'mooncake', got {self.cluster_store!r}")
        if self.cluster_protocol not in ("tcp", "rdma"):
            raise ValueError(f"cluster_protocol must be tcp or rdma, got {self.cluster_protocol!r}")
        if self.cluster_segment_bytes and self.cluster_segment_bytes < 16 * MIB:
            raise ValueError("cluster_segment_bytes must be 0 (use the cluster only) or at least 16 MiB")
        if self.cluster_timeout_ms <= 0:
            raise ValueError("cluster_timeout_ms must be positive")
        if not self.node or not self.node.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"node must be letters, digits, '-' and '_', got {self.node!r}")
        parse_cpus(self.cpus)
