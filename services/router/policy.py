"""Choosing workers: pure logic, no I/O.

Prefill (cache_aware): the estimated TTFT, Mooncake Conductor's rule,
    queue_wait(P) + prefill_time(uncached tokens) + fetch_time(tokens its node's store holds beyond
    P's own) + cluster_time(tokens the cluster tier holds beyond those)
plus prefill_time(uncached tokens) once more: what computing them costs the pool, whose later
requests wait behind that work (choosing by TTFT alone, a prompt left its cached worker for a
slightly shorter queue, and the two-node compare lost 0.4-0.7 points of block hit ratio against
the best-placed worker: docs/perf-log.md, S39). The queue and the request itself are priced
alike, per request (control calls and steps, whatever a prompt's length: a queue of short, mostly
cached prompts is not free) and per token. The SLO is checked against the TTFT estimate, plus the
paired decode worker's recent time to admit (services/router/stage_latency.py), plus the median
of what recent estimates missed by.
The coefficients are fitted to what the estimate predicts: each prefill's time from the router
sending it (once decode admitted the request) to its first token arriving back, against the
queue it joined and what it computed and fetched from its store and from the cluster (least
squares over the recent ones), not constants.
Decode: among workers with room for prompt + max_tokens, the most free KV blocks, then fewest
running sequences.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from services.router.recent import RecentMedian


@dataclass(frozen=True)
class PrefillCandidate:
    worker_id: str
    queued_tokens: int
    local_hit_tokens: int
    inflight: int
    store_hit_tokens: int | None = None  # leading tokens it can load (own run + store); None: the pool-wide figure
    queued_requests: int = 0  # prefills there ahead of this one
    cluster_hit_tokens: int = 0  # tokens the cluster tier holds right after what it can load from its node


@dataclass(frozen=True)
class PrefillCost:
    """What a prefill's time to first token is priced by: the requests and tokens to compute
    (its queue's and its own) and the tokens it fetches from its node's store and from the cluster."""

    requests: int
    tokens: int
    fetched: int
    cluster: int = 0


@dataclass(frozen=True)
class DecodeCandidate:
    worker_id: str
    free_blocks: int
    running: int


@dataclass(frozen=True)
class PrefillChoice:
    worker_id: str
    estimated_ttft_ms: float
    expected_local_tokens: int
    expected_store_tokens: int  # from the store, the cluster's included
    best_hit_tokens: int  # the most any candidate could have reused: what the choice gave up for load shows
    queue: PrefillCost  # the chosen worker's queue, as estimated


class Coefficients:
    """ms per prefill request, per computed token, per token fetched from the node's store and per
    token fetched from the cluster tier: ms(cost) = requests * request_ms + tokens *
    prefill_ms_per_token + fetched * fetch_ms_per_token + cluster * cluster_ms_per_token.

    The two fetch coefficients are fitted to measured loads: the time each prefill spent reading
    its store's blocks (cluster fetches included) against how many it read from each, plus a fixed
    part every load pays (which request_ms carries): inferred from times to first token instead,
    queueing lands on whichever column happens to go with busy moments. request_ms and
    prefill_ms_per_token are then fitted to the times to first token, with what the loads cost
    taken out. Both by least squares over the last WINDOW prefills; a coefficient the samples
    cannot tell (its column never varies) or that comes out negative keeps its value. Owns those
    samples."""

    WINDOW, REFIT_EVERY, MIN_SAMPLES = 256, 16, 32
    MISS_HORIZON_S = 5.0  # what estimates missed by counts this long
    NAMES = ("request_ms", "prefill_ms_per_token", "fetch_ms_per_token", "cluster_ms_per_token")

    def __init__(self, prefill_ms_per_token: float = 0.1, fetch_ms_per_token: float = 0.01,
                 request_ms: float = 5.0, cluster_ms_per_token: float = 0.03, clock=time.monotonic):
        self.request_ms = request_ms
        self.prefill_ms_per_token = prefill_ms_per_token
        self.fetch_ms_per_token = fetch_ms_per_token
        self.cluster_ms_per_token = cluster_ms_per_token
        self._recent: deque[tuple[int, int, int, int, float]] = deque(maxlen=self.WINDOW)
        self._loads: deque[tuple[int, int, int, float]] = deque(maxlen=self.WINDOW)
        self.samples = 0
        self.fitted: frozenset[str] = frozenset()  # the coefficients the last fit could tell (the rest: as given)
        self._misses = RecentMedian(self.MISS_HORIZON_S, self.MIN_SAMPLES, self.WINDOW, clock)  # measured - estimated

    def gauges(self) -> dict[str, float]:
        """The coefficients the last fit could tell, how many prefills it saw, and what the SLO
        check adds to an estimate, for /metrics."""
        return {**{f"router_ttft_{n}": getattr(self, n) for n in self.NAMES if n in self.fitted},
                "router_ttft_samples": self.samples, "router_ttft_miss_ms": self.miss_ms}

    def ms(self, c: PrefillCost) -> float:
        return (c.requests * self.request_ms + c.tokens * self.prefill_ms_per_token
                + c.fetched * self.fetch_ms_per_token + c.cluster * self.cluster_ms_per_token)

    def observe(self, cost: PrefillCost, first_token_ms: float, load_ms: float | None = None) -> None:
        """A prefill of `cost` (its queue's and its own; `fetched` and `cluster`: its own) took
        `first_token_ms` to its first token, `load_ms` of it reading from its store (None: not
        reported)."""
        if first_token_ms <= 0:
            return
        self._recent.append((cost.requests, cost.tokens, cost.fetched, cost.cluster, first_token_ms))
        if load_ms is not None and load_ms >= 0:
            self._loads.append((1, cost.fetched, cost.cluster, load_ms))
        self.samples += 1
        if len(self._recent) >= self.MIN_SAMPLES and self.samples % self.REFIT_EVERY == 0:
            self._fit()

    def missed(self, ms: float) -> None:
        """A prefill's time to first token came `ms` later than its estimate (earlier: < 0). The
        SLO check adds the median of the recent ones to each estimate: choosing the lowest of
        several noisy estimates picks, as a rule, one that is short (docs/perf-log.md, S41)."""
        self._misses.add(ms)

    @property
    def miss_ms(self) -> float:
        """The median of what the estimates of the last MISS_HORIZON_S (at most WINDOW) missed
        by, once there are MIN_SAMPLES of them; else 0. Only admitted requests are measured, so a
        correction kept past its moment would latch: one above the SLO refuses every request,
        and no measurement ever comes to lower it (S42: 2,153 ms against an SLO of 2,000 ms,
        1,468 of 2,000 requests refused)."""
        return self._misses.value()

    def _fit(self) -> None:
        told: set[str] = set()
        data = np.array(self._recent, dtype=np.float64)
        if len(self._loads) >= self.MIN_SAMPLES:
            fetch = self.NAMES[2:]  # columns 2 and 3 of the first-token samples
            fit = _nonneg_lstsq(np.array(self._loads, dtype=np.float64),
                                [0.0, *(getattr(self, n) for n in fetch)], intercept=True)
            for col, name, v in zip((2, 3), fetch, fit[1:], strict=True):  # fit[0]: the fixed part, not kept
                if v is not None:
                    setattr(self, name, v)
                    told.add(name)
                    # What the loads cost, out of the times to first token; fitted only from them.
                    data[:, 4] -= data[:, col] * v
                    data[:, col] = 0
        fit = _nonneg_lstsq(data, [getattr(self, n) for n in self.NAMES])
        for name, v in zip(self.NAMES, fit, strict=True):
            if v is not None:
                setattr(self, name, v)
                told.add(name)
        self.fitted = frozenset(told)


def _nonneg_lstsq(data: np.ndarray, given: list[float], intercept: bool = False) -> list[float | None]:
    """Least squares of the last column on the others, each coefficient >= 0: one the samples
    cannot tell (its column never varies) or that comes out negative is held at `given` and the
    rest fitted again without it. `intercept`: the first column is all ones, fitted as such. Each
    coefficient fitted, or None where it was held."""
    k = data.shape[1] - 1
    x, y = data[:, :k], data[:, k]
    free = [i for i in range(k) if (intercept and i == 0) or np.ptp(x[:, i]) > 0]
    while free:
        fixed = [i for i in range(k) if i not in free]
        rest = y - sum(x[:, i] * given[i] for i in fixed)
        fit = np.linalg.lstsq(x[:, free], rest, rcond=None)[0]
        if (fit >= 0).all():
            out: list[float | None] = [None] * k
            for i, v in zip(free, fit, strict=True):
                out[i] = float(v)
            return out
        free = [i for i, v in zip(free, fit, strict=True) if v >= 0]
    return [None] * k


def estimate_ttft_ms(c: PrefillCandidate, prompt_tokens: int, store_hit_tokens: int, coef: Coefficients) -> tuple[
        float, int, int]:
    """(estimate, tokens P reuses from its own cache, tokens it fetches from the store and the
    cluster)."""
    local = min(c.local_hit_tokens, prompt_tokens - 1)
    if c.store_hit_tokens is not None:
        store_hit_tokens = c.store_hit_tokens
    loadable = max(local, min(store_hit_tokens, prompt_tokens - 1))
    fetched = loadable - local
    cluster = max(0, min(loadable + c.cluster_hit_tokens, prompt_tokens - 1) - loadable)
    uncached = prompt_tokens - loadable - cluster
    cost = PrefillCost(c.queued_requests + 1, c.queued_tokens + uncached, fetched, cluster)
    return coef.ms(cost), local, fetched + cluster


def over_slo(estimate_ms: float, waited_ms: float, slo_ms: float, handoff_ms: float = 0.0) -> str:
    """Why a request is refused under a TTFT SLO (0: none), or "" when it is not. `handoff_ms`:
    how long after its first token its stream would wait for the handoff to complete."""
    over = waited_ms + estimate_ms + handoff_ms - slo_ms
    if not slo_ms or over <= 0:
        return ""
    waited = f" after {waited_ms:.0f} ms waiting to be admitted" if waited_ms >= 1 else ""
    then = f", then {handoff_ms:.0f} ms for its handoff to complete," if handoff_ms >= 1 else ""
    return (f"estimated TTFT {estimate_ms:.0f} ms{then}{waited} exceeds the SLO {slo_ms:.0f} ms; "
            f"retry in about {over:.0f} ms")


class Policy:
    """Owns the round-robin cursor and when each worker was last chosen; everything else is
    computed per request."""

    def __init__(self, name: str):
        self.name = name
        self._rr = itertools.count()
        self._turn = itertools.count()
        self._last_chosen: dict[str, int] = {}

    def keep_only(self, worker_ids: Collection[str]) -> None:
        """Forget when workers not among these were chosen (see RecentRoutes.keep_only)."""
        for worker_id in self._last_chosen.keys() - set(worker_ids):
            del self._last_chosen[worker_id]

    def _staleness(self, worker_id: str) -> int:
        return self._last_chosen.get(worker_id, -1)

    def choose_prefill(self, cands: list[PrefillCandidate], prompt_tokens: int, store_hit_tokens: int,
                       coef: Coefficients) -> PrefillChoice:
        scored = [(estimate_ttft_ms(c, prompt_tokens, store_hit_tokens, coef), c) for c in cands]
        if self.name == "round_robin":
            (est, local, fetched), c = scored[next(self._rr) % len(scored)]
        elif self.name == "least_loaded":
            (est, local, fetched), c = min(scored, key=lambda s: (s[1].queued_tokens + s[1].inflight,
                                                                  self._staleness(s[1].worker_id), s[1].worker_id))
        else:
            def cost(s):  # the TTFT estimate, plus the pool's compute for what is not cached
                return s[0][0] + (prompt_tokens - s[0][1] - s[0][2]) * coef.prefill_ms_per_token

            # Ties (e.g. a prefix cached nowhere, an idle pool) go to the least busy, then to the one
            # chosen longest ago: new prefixes spread over every worker's cache instead of churning
            # the first one's while the others sit empty (SGLang's router balances the same way).
            (est, local, fetched), c = min(scored, key=lambda s: (cost(s), -s[0][1], s[1].inflight,
                                                                  self._staleness(s[1].worker_id), s[1].worker_id))
        self._last_chosen[c.worker_id] = next(self._turn)
        best = max(s[0][1] + s[0][2] for s in scored)
        return PrefillChoice(c.worker_id, est, local, fetched, best, PrefillCost(c.queued_requests, c.queued_tokens, 0))

    @staticmethod
    def choose_decode(cands: list[DecodeCandidate], blocks_needed: int) -> DecodeCandidate | None:
        fits = [c for c in cands if c.free_blocks >= blocks_needed]
        if not fits:
            return None
        return max(fits, key=lambda c: (c.free_blocks, -c.running, c.worker_id))
