"""Per-request records and their summary: percentiles, throughput, hit ratios, SLO attainment,
goodput (DistServe: the highest rate at which >= 90% of requests meet both TTFT and TPOT SLOs),
and the pooled-cache bound for cache-aware routing."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class Record:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    kind: str = ""
    ok: bool = False
    error: str = ""
    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    e2e_ms: float = math.nan
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_local: int = 0
    cached_store: int = 0  # (of which cached_cluster came from the cluster tier)
    cached_cluster: int = 0
    computed: int = 0
    prefill_worker: str = ""
    expected_hit_tokens: int = 0  # what the router expected this prompt to reuse where it sent it
    best_hit_tokens: int = 0  # what the best-placed prefill worker could have reused, per the router
    route_ms: float = math.nan  # the routing decision, measured inside the router
    router_ttft_ms: float = math.nan  # TTFT measured inside the router (from the request reaching it)
    estimated_ttft_ms: float = math.nan  # the router's TTFT estimate when it routed the request
    error_ms: float = math.nan  # a failed request: how long its failure took to arrive

    def to_dict(self) -> dict:
        return asdict(self)

    def finish(self, t0: float) -> None:
        """The request that started at perf_counter `t0` ended well, now."""
        self.e2e_ms = (time.perf_counter() - t0) * 1e3
        if self.output_tokens > 1:
            self.tpot_ms = (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)
        self.ok = True

    def fail(self, t0: float, e: Exception) -> None:
        """The request that started at perf_counter `t0` failed with `e`, now."""
        self.error_ms = (time.perf_counter() - t0) * 1e3
        self.error = f"{type(e).__name__}: {e}"


async def gather_progress(coros: list, progress: bool) -> list:
    """Every coroutine's result, in order, with a progress bar on stderr as they complete."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    done = 0
    for fut in asyncio.as_completed(tasks):
        await fut
        done += 1
        if progress:
            sys.stderr.write(f"\r[{'#' * (30 * done // len(tasks)):<30}] {done}/{len(tasks)} requests")
            sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    return [t.result() for t in tasks]


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for no data."""
    vals = sorted(x for x in xs if not math.isnan(x))
    if not vals:
        return math.nan
    pos = (len(vals) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def meets_slo(r: Record, ttft_ms: float, tpot_ms: float) -> bool:
    """Served within both SLOs; a TTFT (or TPOT) not measured does not meet one (NaN compares false)."""
    if not r.ok or not r.ttft_ms <= ttft_ms:
        return False
    return r.output_tokens <= 1 or r.tpot_ms <= tpot_ms


def attainment(records: Sequence[Record], ttft_ms: float, tpot_ms: float) -> float:
    """The share of requests served within both SLOs; NaN (not measured) for no requests."""
    return sum(meets_slo(r, ttft_ms, tpot_ms) for r in records) / len(records) if records else math.nan


def goodput(attained_by_rate: dict[float, float], threshold: float = 0.9) -> float:
    """Highest swept rate up to which every swept rate attains >= threshold (0 when the lowest
    does not): a rate that passes above one that failed is luck, not capacity. An attainment not
    measured (NaN) does not pass."""
    best = 0.0
    for rate in sorted(attained_by_rate):
        if not attained_by_rate[rate] >= threshold:
            break
        best = rate
    return best


REFUSAL_REASONS = (  # (what the router's or a worker's message says, the reason reported)
    ("waiting to be admitted exceeds the SLO", "over_slo_after_waiting"),
    ("exceeds the SLO", "over_slo"),
    ("already queued for room", "queue_full"),
    ("queued for room it would wait", "expected_wait"),
    ("in the admission queue", "queue_timeout"),
    ("store full", "store_full"),
    ("decode:", "decode_refused"),
)


def is_refusal(error: str) -> bool:
    """Refused for load: gRPC's RESOURCE_EXHAUSTED, or the HTTP status an OpenAI API gives it (429)."""
    return "RESOURCE_EXHAUSTED" in error or "HTTP 429:" in error


def refusal_reason(error: str) -> str:
    """Which admission rule refused a request, from its error message."""
    return next((reason for text, reason in REFUSAL_REASONS if text in error), "other")


def summarize(records: Sequence[Record], wall_s: float, ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
    ok = [r for r in records if r.ok]
    out: dict = {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok), "wall_s": wall_s}
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        vals = [getattr(r, name) for r in ok]
        out[name] = {f"p{q}": percentile(vals, q) for q in (50, 90, 99)}
    itl = [x for r in ok for x in r.itl_ms]
    out["itl_ms"] = {f"p{q}": percentile(itl, q) for q in (50, 90, 99)}
    out["route_ms"] = {f"p{q}": percentile([r.route_ms for r in ok], q) for q in (50, 90, 99)}
    out["router_ttft_ms"] = {f"p{q}": percentile([r.router_ttft_ms for r in ok], q) for q in (50, 90, 99)}
    # What the router's estimate missed by (measured - estimated, in the router, both from its handler).
    missed = [r.router_ttft_ms - r.estimated_ttft_ms for r in ok if r.estimated_ttft_ms > 0]
    if missed:
        out["ttft_estimate_error_ms"] = {f"p{q}": percentile(missed, q) for q in (10, 50, 90)}
    out["error_samples"] = sorted({r.error for r in records if not r.ok})[:5]
    # Refusals (RESOURCE_EXHAUSTED: overload said so) apart from every other error, and how fast.
    refused = [r for r in records if not r.ok and is_refusal(r.error)]
    out["refused"], out["other_errors"] = len(refused), out["errors"] - len(refused)
    out["refusal_ms"] = {f"p{q}": percentile([r.error_ms for r in refused], q) for q in (50, 99)}
    by_reason: dict[str, list[float]] = {}
    for r in refused:
        by_reason.setdefault(refusal_reason(r.error), []).append(r.error_ms)
    out["refusals_by_reason"] = {k: {"n": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
                                 for k, v in sorted(by_reason.items())}
    out["throughput_rps"] = len(ok) / wall_s if wall_s > 0 else math.nan
    out["output_tok_s"] = sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else math.nan
    prompt = sum(r.prompt_tokens for r in ok)
    local, store = sum(r.cached_local for r in ok), sum(r.cached_store for r in ok)
    out["prefix_hit_ratio_tokens"] = (local + store) / prompt if prompt else math.nan  # (none served: NaN)
    out["hit_tokens_local"], out["hit_tokens_store"], out["prompt_tokens"] = local, store, prompt
    out["slo"] = {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms,
                  "attainment": attainment(records, ttft_slo_ms, tpot_slo_ms)}
    return out


def lru_hit_ratio(chains: Iterable[Sequence[object]], capacity_blocks: int) -> float:
    """Block hit ratio of one LRU cache of `capacity_blocks` over requests' block chains, in order.

    A block hits when it is cached as part of the request's leading cached run (prefix caching:
    a block after a miss cannot be reused), then every block of the request is inserted.
    """
    cache: OrderedDict[object, None] = OrderedDict()
    hits = total = 0
    for chain in chains:
        total += len(chain)
        for block in chain:
            if block not in cache:
                break
            hits += 1
        for block in chain:
            cache[block] = None
            cache.move_to_end(block)
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return hits / total if total else math.nan
