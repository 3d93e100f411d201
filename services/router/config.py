"""Router configuration (env PDSERVE_* or flags)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import field
from pdserve.rpc.stream_interval import MAX_STREAM_INTERVAL
from pdserve.runtime.service import parse_cpus

POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterConfig:
    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(0, "port (0: any free port)")
    port_file: str = field("", "write the bound port here once serving")
    model: str = field("tiny", "model whose tokenizer and hash profile the pool serves")
    dtype: str = field("float32", "KV dtype of the pool")
    engine: str = field("real", "real | mock: the workers' engine (mock KV has its own profile)")
    block_size: int = field(16, "tokens per KV block")
    redis_url: str = field("redis://127.0.0.1:6379/0", "Redis: worker registry, prefix index, hit counters")
    key_prefix: str = field("pdserve", "prefix of every Redis key")
    policy: str = field("cache_aware", "prefill choice: cache_aware | round_robin | least_loaded")
    colocate_below_tokens: int = field(0, "uncached prompt tokens under which decode prefills itself (0: never)")
    ttft_slo_ms: float = field(0.0, "refuse when the TTFT estimate plus the wait so far exceeds it (0: no SLO)")
    max_tokens_cap: int = field(4096, "largest max_tokens a request may ask for")
    max_prompt_tokens: int = field(0, "largest prompt (0: the model's context length)")
    max_prompt_bytes: int = field(16 << 20, "largest prompt text in bytes")
    index_mirror: bool = field(True, "keep the prefix index in memory, fed by Redis's change events (off: ask "
                                     "Redis on every request)")
    refresh_s: float = field(0.25, "how often the worker registry is re-read and health-checked")
    request_timeout_s: float = field(30.0, "deadline of a request whose client sets none: this, plus the two "
                                           "below per prompt and per output token")
    timeout_ms_per_prompt_token: float = field(5.0, "added to the default deadline per prompt token")
    timeout_ms_per_output_token: float = field(250.0, "added to the default deadline per max_tokens")
    prefill_retries: int = field(1, "times a prefill that fails before the first token is tried on another "
                                    "prefill worker")
    max_queued: int = field(256, "requests that may wait for a decode worker with room; past it, refused at once")
    queue_timeout_s: float = field(2.0, "how long a request waits in the admission queue before it is refused")
    max_migrations: int = field(2, "times a request whose decode worker fails mid-stream resumes on another")
    store: str = field("", "kvstore address, for its stats in Status (optional)")
    http_port: int = field(-1, "OpenAI-compatible HTTP API port (-1: off, 0: any free port)")
    http_port_file: str = field("", "write the HTTP API's port here once serving")
    served_model_name: str = field("", "the model's name in the HTTP API (default: --model as given)")
    metrics_port: int = field(-1, "Prometheus /metrics port (-1: off, 0: any free port)")
    grace_s: float = field(5.0, "drain period on SIGTERM")
    stream_interval: int = field(1, "gRPC and HTTP streams: send tokens N at a time (the first at once, the last "
                                    "when the request ends): fewer messages, and fewer system calls, a token")
    cpus: str = field("", "CPU ids the router runs on, taskset-style, e.g. '1' or '0-3' (default: all)")

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if min(self.request_timeout_s, self.timeout_ms_per_prompt_token, self.timeout_ms_per_output_token) < 0:
            raise ValueError("request timeouts must not be negative")
        if self.max_tokens_cap <= 0:
            raise ValueError("max_tokens_cap must be positive")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}")
        parse_cpus(self.cpus)

    def deadline_s(self, prompt_tokens: int, max_tokens: int, client_s: float | None) -> float:
        """Seconds a request may take at every hop: the client's deadline when it set one, else a
        default sized to the work."""
        if client_s is not None:
            return max(client_s, 0.001)
        return (self.request_timeout_s + prompt_tokens * self.timeout_ms_per_prompt_token / 1e3
                + max_tokens * self.timeout_ms_per_output_token / 1e3)
