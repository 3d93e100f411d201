"""What the router's request path hands around: the route chosen, the tokens out, the summary."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from services.router.policy import PrefillCost
from services.router.workers import WorkerView

# A worker's call that ended with one of these may succeed on another worker.
RETRY_ON = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              grpc.StatusCode.ABORTED})


@dataclass(frozen=True)
class Route:
    prefill: WorkerView | None  # None: colocated on decode
    decode: WorkerView
    policy: str
    expected_local_tokens: int
    expected_store_tokens: int
    estimated_ttft_ms: float
    route_ms: float
    best_hit_tokens: int = 0  # the most prompt tokens any prefill worker could have reused, per the index
    decode_blocks: int = 0  # KV blocks the request reserves on its decode worker
    prefill_queue: PrefillCost | None = None  # what was ahead of it on its prefill worker, as estimated

    def queued_tokens(self, prompt_tokens: int) -> int:
        """What this request adds to its prefill worker's queue: the tokens it is expected to
        compute, not those it reuses (the worker's own queue figure counts the same way)."""
        return max(1, prompt_tokens - self.expected_local_tokens - self.expected_store_tokens)


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str
    logprob: float
    index: int
    finish_reason: int


@dataclass
class Summary:
    request_id: str
    finish_reason: int
    route: Route
    prompt_tokens: int
    completion_tokens: int = 0
    cached_local: int = 0
    cached_store: int = 0
    computed: int = 0
    cached_cluster: int = 0  # of cached_store: fetched from the cluster tier
    timings_ms: dict[str, float] = field(default_factory=dict)


def log_request(log, request_id: str, prompt_tokens: int, summary: Summary | None, status: str) -> None:
    """One line per request, however it ended."""
    if summary is None:
        log.info("request", request_id=request_id, status=status, prompt_tokens=prompt_tokens)
        return
    r = summary.route
    log.info("request", request_id=request_id, status=status, prompt_tokens=prompt_tokens,
             cached_tokens=summary.cached_local + summary.cached_store, output_tokens=summary.completion_tokens,
             ttft_ms=round(summary.timings_ms.get("ttft_ms", 0.0), 2), prefill=r.prefill.address if r.prefill else "",
             decode=r.decode.address)
