"""The mock engine: no model compute. A step takes the time a cost model says (the engine thread
sleeps), writes a deterministic pattern into the new tokens' KV slots (so transfers move real
bytes and checksums mean something), and picks a deterministic next token. Scheduling, block
accounting, prefix caching, the store and every RPC stay real. For scale tests beyond this machine.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kv.layout import HashProfile, KVLayout

if TYPE_CHECKING:
    from pdserve.model.loader import LoadedModel
    from pdserve.model.spec import ModelSpec


@dataclass(frozen=True)
class CostModel:
    """Step time in ms = step_ms + per prompt chunk (n tokens after c cached): n*prefill_ms_per_token
    + n*(c + n/2)*prefill_ms_per_token_ctx; + per decoding sequence decode_ms_per_seq
    + its context * decode_ms_per_ctx_token."""

    # Defaults: fitted to the real `tiny` engine on the development machine (2 vCPUs, fp32) with
    # `pdserve bench capacity --fit-cost-model`, 2026-11-29. Refit, or --mock-scale, for others.
    step_ms: float = 4.84
    prefill_ms_per_token: float = 0.0822
    prefill_ms_per_token_ctx: float = 2.16e-5
    decode_ms_per_seq: float = 0.093
    decode_ms_per_ctx_token: float = 1.27e-4

    def step_time_ms(self, output: SchedulerOutput) -> float:
        t = self.step_ms
        for c in output.chunks:
            n, ctx = c.num_tokens, c.start
            if n == 1 and c.start >= c.seq.num_prompt_tokens:
                t += self.decode_ms_per_seq + ctx * self.decode_ms_per_ctx_token
            else:
                t += n * self.prefill_ms_per_token + n * (ctx + n / 2) * self.prefill_ms_per_token_ctx
        return t

    def scaled(self, factor: float) -> CostModel:
        return CostModel(**{k: v * factor for k, v in asdict(self).items()})

    @classmethod
    def load(cls, spec: str) -> CostModel:
        """'' for the defaults, a JSON file path, or inline JSON."""
        if not spec:
            return cls()
        text = Path(spec).read_text() if not spec.lstrip().startswith("{") else spec
        return cls(**json.loads(text))


class MockRunner:
    """Same interface as ModelRunner.run; writes only the pages of the chunks it was given."""

    def __init__(self, kv_cache: KVCache, vocab_size: int, cost: CostModel):
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.vocab_size = vocab_size
        self.cost = cost

    def run(self, output: SchedulerOutput) -> dict[str, tuple[int, float]]:
        t0 = time.perf_counter()
        sampled = {}
        for chunk in output.chunks:
            seq, bs = chunk.seq, self.block_size
            positions = range(chunk.start, chunk.start + chunk.num_tokens)
            tokens = seq.token_at(chunk.start, chunk.start + chunk.num_tokens)
            blocks = torch.tensor([seq.block_table[p // bs] for p in positions])
            offsets = torch.tensor([p % bs for p in positions])
            # A slot's pattern depends on the token and its position only: same tokens, same KV.
            values = torch.tensor([(t * 131 + p) % 997 / 997.0 for t, p in zip(tokens, positions, strict=True)],
                                  dtype=self.kv_cache.tensor.dtype)
            cache = self.kv_cache.tensor  # [blocks, layers, 2, kv_heads, block_size, head_dim]
            cache.permute(0, 4, 1, 2, 3, 5)[blocks, offsets] = values.view(-1, 1, 1, 1, 1)
            if chunk.sample:
                context = seq.token_at(max(0, chunk.start + chunk.num_tokens - 8), chunk.start + chunk.num_tokens)
                digest = hashlib.blake2b(repr((context, chunk.start + chunk.num_tokens)).encode(),
                                         digest_size=8).digest()
                sampled[seq.request_id] = (int.from_bytes(digest, "little") % min(self.vocab_size, 250), -1.0)
        remaining = self.cost.step_time_ms(output) / 1000 - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return sampled


def mock_fingerprint(model_fingerprint: str) -> str:
    """Mock KV is not the model's KV: a distinct profile, so mock and real workers never mix."""
    return "mock-" + hashlib.sha256(("mock:" + model_fingerprint).encode()).hexdigest()[:59]


def served_profile(model: ModelSpec | LoadedModel, block_size: int, mock: bool) -> HashProfile:
    """The hash profile a pool of workers serving `model` shares (the engine, the router and the
    store each take theirs from here): mock KV has a profile of its own."""
    fingerprint = mock_fingerprint(model.fingerprint) if mock else model.fingerprint
    return HashProfile(fingerprint, KVLayout.for_model(model.config, block_size, model.dtype))
