"""Fit the mock engine's cost model to the real engine's measured step times on this machine."""

from __future__ import annotations

import time

import torch

from pdserve.bench.engine_bench import decode_step_ms
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.mock_runner import CostModel
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import LoadedModel


def _timed_prefill(loaded: LoadedModel, n: int) -> float:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=n // 16 + 8, max_num_batched_tokens=max(n, 16),
                                            enable_prefix_caching=False))
    t0 = time.perf_counter()
    engine.generate([[i % 250 for i in range(n)]], SamplingParams(max_tokens=1))
    return (time.perf_counter() - t0) * 1e3


def _timed_decode(loaded: LoadedModel, batch: int, ctx: int, steps: int = 8) -> float:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=batch * (ctx + steps + 16) // 16 + 8,
                                            max_num_batched_tokens=max(ctx, 2048), max_num_seqs=batch,
                                            enable_prefix_caching=False))
    return decode_step_ms(engine, [[(i + j) % 250 for i in range(ctx)] for j in range(batch)], steps)


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return [max(0.0, v) for v in torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()]


def fit(loaded: LoadedModel) -> CostModel:
    pre = [(n, _timed_prefill(loaded, n)) for n in (128, 512, 1024, 2048, 4096)]
    a, b = _lstsq([[n, n * n / 2] for n, _ in pre], [t for _, t in pre])
    dec = [(bt, c, _timed_decode(loaded, bt, c)) for bt in (1, 8, 32) for c in (128, 1024)]
    step, d, e = _lstsq([[1, bt, bt * c] for bt, c, _ in dec], [t for *_, t in dec])
    return CostModel(step_ms=step, prefill_ms_per_token=a, prefill_ms_per_token_ctx=b, decode_ms_per_seq=d,
                     decode_ms_per_ctx_token=e)
