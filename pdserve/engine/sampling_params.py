"""Sampling parameters, validated where a request becomes them. Free of torch, so that the
client-side CLI (which validates before any call) starts without it."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TEMPERATURE = 100.0  # far past where sampling is uniform; a bound so no value overflows the logits
MAX_STOP_TOKENS = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Every service that builds these from a request checks them here: NaN compares false
        # with everything, so each range test is written to fail on it.
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if len(self.stop_token_ids) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop token ids, got {len(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
