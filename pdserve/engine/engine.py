"""LLMEngine: the one entry point to the engine, for all three roles.

Not thread-safe: one engine thread owns it (services feed it through a queue).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pdserve.engine.config import EngineConfig, Role
from pdserve.engine.device import resolve_device
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.malloc import keep_freed_memory
from pdserve.engine.mock_runner import MockRunner, served_profile
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenEvent
from pdserve.kv.hashing import BlockHash, block_hashes
from pdserve.kv.layout import HashProfile
from pdserve.model.loader import LoadedModel


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    num_cached_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class Reservation:
    request_id: str
    block_table: list[int]  # pages: prompt blocks first
    num_cached_blocks: int  # leading prompt blocks already here (reused from the prefix cache)
    cached_hashes: list[BlockHash]
    prompt_hashes: list[BlockHash]  # every full prompt block
    num_local_blocks: int = 0  # leading prompt blocks already in our pages (shared or copied here)


@dataclass(frozen=True)
class KVExport:
    """A prefilled sequence's KV, ready to continue elsewhere: every prompt block, the tail included."""

    request_id: str
    profile: HashProfile
    prompt_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]  # full blocks only
    data: torch.Tensor  # [ceil(len(prompt_ids) / block_size), *layout.block_shape]
    first_token: int
    first_logprob: float


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.model = loaded
        keep_freed_memory()
        self.max_model_len = min(self.config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.profile = served_profile(loaded, self.config.block_size, mock=self.config.mock_cost is not None)
        # The mock engine computes nothing: its pages stay in host memory whatever `auto` finds.
        self.device = torch.device("cpu") if self.config.mock_cost is not None else resolve_device(self.config.device)
        self.kv_cache = KVCache(self.profile.layout, self.config.num_blocks, self.device)
        self.scheduler = Scheduler(self.config, self.profile, loaded.config.eos_token_ids, self.max_model_len)
        if self.config.mock_cost is not None:
            self.runner = MockRunner(self.kv_cache, loaded.config.vocab_size, self.config.mock_cost)
        else:
            loaded.model.to(self.device)
            self.runner = ModelRunner(loaded.model, self.kv_cache, self.config.attention_backend,
                                      self.config.linear_weights)
        self._ids = itertools.count()
        self.last_batch: list[str] = []
        self.last_progress: dict[str, int] = {}

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- requests --------------------------------------------------------------------------
    def _new_sequence(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> Sequence:
        if request_id in self.scheduler.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt_ids) == 0:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}"
            )
        return Sequence(request_id, list(prompt_ids), params, self.block_size,
                        stop_after_prefill=self.config.role == Role.PREFILL)

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        self.scheduler.add(self._new_sequence(request_id, prompt_ids, params))

    def step(self) -> list[TokenEvent]:
        self.last_batch = []  # (a schedule that raises has run no one: no earlier step's batch is named)
        output = self.scheduler.schedule()
        self.last_batch = [c.seq.request_id for c in output.chunks]  # what a step that raises was running
        if not output.chunks:
            self.last_progress = {}
            return []
        sampled = self.runner.run(output)
        now = time.perf_counter()
        for chunk in output.chunks:
            if chunk.sample and chunk.seq.first_token_time is None:
                chunk.seq.first_token_time = now
        events = self.scheduler.update(output, sampled)
        # Tokens with K/V in the pages, per sequence stepped: prefill workers ship full blocks from it.
        self.last_progress = {c.seq.request_id: c.seq.num_computed_tokens for c in output.chunks}
        return events

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def halt(self, request_id: str) -> bool:
        return self.scheduler.halt(request_id)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts to completion (all admitted together, batched continuously)."""
        if self.config.role == Role.PREFILL:
            raise ValueError("generate() needs the colocated or decode role")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self._new_sequence(f"gen-{next(self._ids)}", p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for s in seqs:
            self.scheduler.add(s)
        while any(s.status != SequenceStatus.FINISHED for s in seqs):
            self.step()
        return [self._result(s) for s in seqs]

    @staticmethod
    def _result(s: Sequence) -> GenerationResult:
        return GenerationResult(s.request_id, s.prompt_ids, s.output_ids, s.output_logprobs,
                                s.finish_reason or FinishReason.ABORT, s.num_cached_tokens,
                                (s.first_token_time or s.arrival_time) - s.arrival_time)

    # -- KV handoff ------------------------------------------------------------------------
    def export_kv(self, request_id: str) -> KVExport:
        """Prefill role: copy out a prefilled sequence's prompt blocks (pages stay held)."""
        seq = self.scheduler.seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.PREFILLED:
            raise KeyError(f"no prefilled request {request_id!r} is held")
        num_blocks = seq.blocks_for(seq.num_prompt_tokens)
        return KVExport(
            request_id=request_id,
            profile=self.profile,
            prompt_ids=tuple(seq.prompt_ids),
            block_hashes=tuple(seq.block_hashes[: seq.num_prompt_tokens // self.block_size]),
            data=self.kv_cache.read_blocks(seq.block_table[:num_blocks]),
            first_token=seq.output_ids[0],
            first_logprob=seq.output_logprobs[0],
        )

    def release(self, request_id: str) -> None:
        self.scheduler.release(request_id)

    def import_kv(self, kv: KVExport, params: SamplingParams, request_id: str | None = None) -> TokenEvent:
        """Decode role: take a prompt's KV from another engine and continue decoding it.

        Reuses prompt blocks this engine already caches; writes only the others. Raises
        ValueError for KV that does not belong here, OutOfPagesError when pages are short.
        """
        reason = self.profile.mismatch(kv.profile)
        if reason:
            raise ValueError(f"KV import refused: {reason}")
        rid = request_id or kv.request_id
        expected = (-(-len(kv.prompt_ids) // self.block_size), *self.profile.layout.block_shape)
        if tuple(kv.data.shape) != expected:
            raise ValueError(f"KV import refused: data shape {tuple(kv.data.shape)}, expected {expected}")
        if kv.data.dtype != self.kv_cache.tensor.dtype:
            raise ValueError(f"KV import refused: dtype {kv.data.dtype}, expected {self.kv_cache.tensor.dtype}")
        if list(kv.block_hashes) != block_hashes(kv.prompt_ids, self.profile):
            raise ValueError("KV import refused: block hashes do not match the prompt tokens")
        reservation = self.reserve(rid, kv.prompt_ids, params)
        try:
            start = reservation.num_cached_blocks
            self.kv_cache.write_blocks(reservation.block_table[start : expected[0]], kv.data[start:])
            return self.activate(rid, kv.first_token, kv.first_logprob)
        except BaseException:
            self.abort(rid)  # (a first token activate refuses: its pages and its id go back)
            raise

    # -- handoff in steps (the workers fill pages straight from the store) -------------------
    def reserve(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> Reservation:
        """Take pages for a request whose leading blocks will be filled from outside.

        Prefill role: pages for the prompt; the caller loads blocks, then `start_compute`.
        Decode role: pages for prompt + max_tokens; the caller imports every prompt block, then
        `activate`. Raises ValueError for bad input, OutOfPagesError when pages are short now.
        """
        seq = self._new_sequence(request_id, prompt_ids, params)
        prefill = self.config.role == Role.PREFILL
        num_cached = self.scheduler.reserve(seq, needs_logits=prefill)
        hashes = block_hashes(seq.prompt_ids, self.profile)
        num_local = num_cached
        if prefill and num_cached == len(hashes) - 1 and seq.num_prompt_tokens % self.block_size == 0:
            # Every prompt block is cached here but the last one was not shared (its last token is
            # recomputed, which writes into the page): copy it into our own page instead of
            # recomputing the whole block. Looked up again after allocation, which may evict.
            cached = self.scheduler.pool.match_prefix(hashes)
            if len(cached) == len(hashes):
                last = torch.tensor([cached[-1]])
                self.kv_cache.tensor[torch.tensor([seq.block_table[num_cached]])] = self.kv_cache.tensor[last]
                num_local += 1
        return Reservation(request_id, list(seq.block_table), num_cached, list(seq.block_hashes), hashes, num_local)

    def start_compute(self, request_id: str, num_loaded_blocks: int) -> None:
        seq = self._reserved(request_id)
        self.scheduler.mark_loaded(seq, num_loaded_blocks)
        self.scheduler.start_compute(seq)

    def activate(self, request_id: str, first_token: int, first_logprob: float) -> TokenEvent:
        if not 0 <= first_token < self.model.config.vocab_size:
            raise ValueError(f"first token {first_token} outside the vocabulary")
        return self.scheduler.activate_imported(self._reserved(request_id), first_token, first_logprob)

    def _reserved(self, request_id: str) -> Sequence:
        seq = self.scheduler.seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.RUNNING or seq in self.scheduler.running:
            raise KeyError(f"no reserved request {request_id!r}")
        return seq

    def sequence(self, request_id: str) -> Sequence | None:
        return self.scheduler.seqs.get(request_id)

    def load(self) -> dict[str, int]:
        s = self.scheduler
        queued = sum(q.num_prompt_tokens - q.num_computed_tokens for q in (*s.waiting, *s.running) if q.is_prefilling)
        return {"queued_tokens": queued, "running_requests": len(s.running) + len(s.waiting),
                "free_kv_blocks": s.pool.num_free_blocks, "total_kv_blocks": s.pool.num_blocks}
