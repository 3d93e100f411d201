"""Choosing workers: pure logic, no I/O.

Prefill (cache_aware): the lowest estimated TTFT, Mooncake Conductor's rule:
    queue_wait(P) + prefill_time(uncached tokens) + fetch_time(store-held tokens beyond P's own)
with per-token coefficients learned from the workers' reported timings (EWMA), not constants.
Decode: among workers with room for prompt + max_tokens, the most free KV blocks, then fewest
running sequences.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCandidate:
    worker_id: str
    queued_tokens: int
    local_hit_tokens: int
    inflight: int
    store_hit_tokens: int | None = None  # leading tokens it can load (own run + store); None: the pool-wide figure


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
    expected_store_tokens: int
    best_hit_tokens: int  # the most any candidate could have reused: what the choice gave up for load shows


class Coefficients:
    """ms per computed prompt token and per store-fetched token, learned from PrefillResponses."""

    def __init__(self, prefill_ms_per_token: float = 0.1, fetch_ms_per_token: float = 0.01, alpha: float = 0.2):
        self.prefill_ms_per_token = prefill_ms_per_token
        self.fetch_ms_per_token = fetch_ms_per_token
        self.alpha = alpha
        self.samples = 0

    def observe(self, computed_tokens: int, prefill_ms: float, store_tokens: int, load_ms: float) -> None:
        a = self.alpha
        if computed_tokens > 0 and prefill_ms > 0:
            self.prefill_ms_per_token += a * (prefill_ms / computed_tokens - self.prefill_ms_per_token)
        if store_tokens > 0 and load_ms > 0:
            self.fetch_ms_per_token += a * (load_ms / store_tokens - self.fetch_ms_per_token)
        self.samples += 1


def estimate_ttft_ms(c: PrefillCandidate, prompt_tokens: int, store_hit_tokens: int, coef: Coefficients) -> tuple[
        float, int, int]:
    """(estimate, tokens P reuses from its own cache, tokens it fetches from the store)."""
    local = min(c.local_hit_tokens, prompt_tokens - 1)
    if c.store_hit_tokens is not None:
        store_hit_tokens = c.store_hit_tokens
    fetched = max(0, min(store_hit_tokens, prompt_tokens - 1) - local)
    uncached = prompt_tokens - local - fetched
    queue_ms = c.queued_tokens * coef.prefill_ms_per_token
    return queue_ms + uncached * coef.prefill_ms_per_token + fetched * coef.fetch_ms_per_token, local, fetched


class Policy:
    """Owns the round-robin cursor and when each worker was last chosen; everything else is
    computed per request."""

    def __init__(self, name: str):
        self.name = name
        self._rr = itertools.count()
        self._turn = itertools.count()
        self._last_chosen: dict[str, int] = {}

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
            # Ties (e.g. a prefix cached nowhere, an idle pool) go to the least busy, then to the one
            # chosen longest ago: new prefixes spread over every worker's cache instead of churning
            # the first one's while the others sit empty (SGLang's router balances the same way).
            (est, local, fetched), c = min(scored, key=lambda s: (s[0][0], -s[0][1], s[1].inflight,
                                                                  self._staleness(s[1].worker_id), s[1].worker_id))
        self._last_chosen[c.worker_id] = next(self._turn)
        best = max(s[0][1] + s[0][2] for s in scored)
        return PrefillChoice(c.worker_id, est, local, fetched, best)

    @staticmethod
    def choose_decode(cands: list[DecodeCandidate], blocks_needed: int) -> DecodeCandidate | None:
        fits = [c for c in cands if c.free_blocks >= blocks_needed]
        if not fits:
            return None
        return max(fits, key=lambda c: (c.free_blocks, -c.running, c.worker_id))
