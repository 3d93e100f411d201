"""Scheduler: decides each step's token chunks, admits sequences, owns the block pool.

Policy (continuous batching, chunked prefill under a token budget):
1. every running decode gets its one token first, so inter-token latency never waits on a prompt;
2. prompts already being prefilled continue, in arrival order, within the remaining budget;
3. waiting sequences are admitted first-come-first-served while pages and budget allow.
Admission reserves every page a sequence can ever need (prompt + max_tokens), so a running
sequence never runs out of pages and nothing is ever preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenEvent
from pdserve.kv.hashing import block_hashes, hash_block, root_hash
from pdserve.kv.layout import HashProfile


class OutOfPagesError(RuntimeError):
    """Not enough free KV pages to admit a sequence now (retry later)."""


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the first token computed
    num_tokens: int
    sample: bool  # the chunk reaches the last known token: sample the next one


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Owns the waiting queue, the running list, held (prefilled) sequences and the `BlockPool`."""

    def __init__(self, config: EngineConfig, profile: HashProfile, eos_token_ids: tuple[int, ...],
                 max_model_len: int):
        self.config = config
        self.profile = profile
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every live sequence, whatever its state
        self._root = root_hash(profile)

    # -- admission -------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        need = seq.blocks_for(self._reserved_slots(seq))
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request needs {need} KV pages (prompt {seq.num_prompt_tokens} + max_tokens "
                f"{seq.params.max_tokens}) but the engine has only {self.pool.num_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def reserve(self, seq: Sequence, needs_logits: bool) -> int:
        """Reserve pages for a sequence whose leading blocks will be filled from outside.

        Reuses prompt blocks already cached here; returns how many leading blocks were reused.
        With `needs_logits` (it will compute) the last prompt block is never taken from the
        cache, so at least one token is computed. Raises `OutOfPagesError` at once when the
        pages are not free now. The sequence holds its pages but is not scheduled until
        `start_compute` or `activate_imported`.
        """
        self.check_fits(seq)
        hashes = block_hashes(seq.prompt_ids, self.profile)
        hits = self.pool.match_prefix(hashes)
        if needs_logits:
            hits = hits[: (seq.num_prompt_tokens - 1) // seq.block_size]
        if not self._try_allocate(seq, hashes, hits):
            raise OutOfPagesError(
                f"{self.pool.num_free_blocks} free KV pages, request needs "
                f"{seq.blocks_for(self._reserved_slots(seq)) - len(hits)}"
            )
        self.seqs[seq.request_id] = seq
        return len(hits)

    def mark_loaded(self, seq: Sequence, num_blocks: int) -> None:
        """Blocks [cached, num_blocks) of the prompt were written into the pages from outside.

        The last prompt token is always computed (its logits give the next token), so at most
        len - 1 tokens count as loaded; recomputing it rewrites its slot in our private page.
        """
        seq.num_computed_tokens = max(seq.num_computed_tokens, min(num_blocks * seq.block_size,
                                                                   seq.num_prompt_tokens - 1))
        self._cache_full_blocks(seq)

    def start_compute(self, seq: Sequence) -> None:
        """A reserved sequence computes the rest of its prompt from the next step on."""
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            raise ValueError("start_compute: nothing left to compute (the last token needs its logits)")
        self.running.append(seq)

    def activate_imported(self, seq: Sequence, first_token: int, first_logprob: float) -> TokenEvent:
        """Decode side: the prompt KV is in the pages; continue from prefill's first token."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._cache_full_blocks(seq)
        event = self._append_token(seq, first_token, first_logprob)
        if event.finish_reason is None:
            self.running.append(seq)
        return event

    def _reserved_slots(self, seq: Sequence) -> int:
        if seq.stop_after_prefill:
            return seq.num_prompt_tokens
        return min(seq.num_reserved_slots, self.max_model_len)

    def _try_allocate(self, seq: Sequence, hashes: list, hits: list[int]) -> bool:
        num_new = seq.blocks_for(self._reserved_slots(seq)) - len(hits)
        evictable_hits = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if num_new + evictable_hits > self.pool.num_free_blocks:
            return False
        self.pool.acquire(hits)
        seq.block_table = hits + self.pool.allocate(max(num_new, 0))
        seq.block_hashes = list(hashes[: len(hits)])
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * seq.block_size
        seq.status = SequenceStatus.RUNNING
        return True

    def _admit(self, seq: Sequence) -> bool:
        hashes = block_hashes(seq.prompt_ids, self.profile)
        hits = self.pool.match_prefix(hashes)
        if len(hits) * seq.block_size >= seq.num_prompt_tokens:
            hits = hits[:-1]  # recompute the last block: its last token's logits give the next token
        return self._try_allocate(seq, hashes, hits)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in self.running:
            if not seq.is_prefilling and budget > 0:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1, True))
                budget -= 1
        if budget == 0 and len(chunks) < sum(not seq.is_prefilling for seq in self.running):
            # More decodes than a step's tokens: those stepped now go last, so every one gets its
            # turn (the first ones would otherwise take every step).
            stepped = {id(c.seq) for c in chunks}
            self.running = [q for q in self.running if id(q) not in stepped] + [c.seq for c in chunks]
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= chunks[-1].num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break  # first-come-first-served: the head waits for pages
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= chunks[-1].num_tokens
        return SchedulerOutput(tuple(chunks))

    @staticmethod
    def _prefill_chunk(seq: Sequence, budget: int) -> ScheduledChunk:
        n = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
        done = seq.num_computed_tokens + n == seq.num_prompt_tokens
        return ScheduledChunk(seq, seq.num_computed_tokens, n, done)

    def update(self, output: SchedulerOutput, sampled: dict[str, tuple[int, float]]) -> list[TokenEvent]:
        events = []
        for chunk in output.chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            self._cache_full_blocks(seq)
            if chunk.sample:
                token, logprob = sampled[seq.request_id]
                events.append(self._append_token(seq, token, logprob))
        return events

    def _append_token(self, seq: Sequence, token: int, logprob: float) -> TokenEvent:
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        reason = self._finish_reason(seq, token)
        prefill_done = seq.stop_after_prefill
        if prefill_done:
            seq.finish_reason = reason
            seq.status = SequenceStatus.PREFILLED
            self.running.remove(seq)
        elif reason is not None:
            self._finish(seq, reason)
        index = len(seq.output_ids) - 1
        return TokenEvent(seq.request_id, token, logprob, index, reason, prefill_done,
                          seq.num_cached_tokens if index == 0 else 0)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.params.stop_token_ids or (token in self.eos_token_ids and not seq.params.ignore_eos):
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _cache_full_blocks(self, seq: Sequence) -> None:
        bs = seq.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else self._root
            h = hash_block(parent, seq.token_at(i * bs, (i + 1) * bs))
            seq.block_hashes.append(h)
            self.pool.cache(seq.block_table[i], h)

    # -- ending ----------------------------------------------------------------------------
    def _unschedule(self, seq: Sequence) -> None:
        if seq.status == SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._unschedule(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.request_id]

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        return True

    def halt(self, request_id: str) -> bool:
        """A request whose step failed: out of the schedule at once, its pages kept until `abort`
        (its worker may still be shipping blocks an earlier step wrote in them)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status == SequenceStatus.FINISHED:
            return False
        self._unschedule(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        return True

    def release(self, request_id: str) -> None:
        """Prefill side: the held KV was exported (or is no longer wanted); free its pages."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.PREFILLED:
            raise KeyError(f"no prefilled request {request_id!r} is held")
        self._finish(seq, seq.finish_reason or FinishReason.LENGTH)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
