"""A `Sequence` is one request as it travels through scheduler, runner and sampler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from pdserve.engine.sampling import SamplingParams
from pdserve.kv.hashing import BlockHash


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds pages, computing prompt chunks or decoding
    PREFILLED = "prefilled"  # prefill role: prompt KV complete, pages held until exported/released
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(frozen=True)
class TokenEvent:
    """What one engine step produced for one sequence."""

    request_id: str
    token_id: int
    logprob: float
    index: int  # position in the output (0 = first token)
    finish_reason: FinishReason | None
    prefill_done: bool = False  # prefill role: the prompt's KV is complete and held for export
    cached_tokens: int = 0  # the first token's: prompt tokens reused from the prefix cache


class Sequence:
    """Owned by the scheduler while live; the runner reads it, never writes it."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, block_size: int,
                 stop_after_prefill: bool = False):
        self.request_id = request_id
        self.stop_after_prefill = stop_after_prefill  # prefill role: hold the KV after the first token
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.params = params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.block_hashes: list[BlockHash] = []  # hashes of the full blocks computed so far
        self.num_computed_tokens = 0  # tokens whose K/V are in the pages
        self.num_cached_tokens = 0  # of those, reused from the prefix cache at admission
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def num_reserved_slots(self) -> int:
        """KV slots this sequence can ever need: the last output token's K/V is never computed."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, prompt={self.num_prompt_tokens}, out={len(self.output_ids)}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
