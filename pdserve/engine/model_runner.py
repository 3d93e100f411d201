"""Model runner: turns a `SchedulerOutput` into model inputs, runs the model, samples."""

from __future__ import annotations

import torch

from pdserve import logs
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.sampling import sample
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.model import cpu_kernels
from pdserve.model.llama import AttentionMetadata, DecodeGroup, PagedDecode, SeqAttention, Transformer, page_rows

log = logs.get("engine")

# Decoding sequences are attended in groups, each padded to its longest member; a group takes
# another sequence only while its padded pages stay within this factor of its real pages.
MAX_PADDING = 1.25


class ModelRunner:
    """Runs one step. Reads sequences, writes only the KV cache pages it was given."""

    def __init__(self, model: Transformer, kv_cache: KVCache, attention_backend: str = "auto"):
        self.model = model
        self.attention_backend = self._backend(attention_backend, kv_cache.tensor)
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self._layers = kv_cache.layout.num_layers
        self._kv_heads = kv_cache.layout.num_kv_heads
        self._row_numel = kv_cache.layout.block_size * kv_cache.layout.head_dim
        self._workspace = torch.empty(0, dtype=kv_cache.tensor.dtype)

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> dict[str, tuple[int, float]]:
        """Returns {request_id: (token, logprob)} for the chunks that sample."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        seqs: list[SeqAttention] = []
        decoding: list[tuple[int, list[int], int]] = []  # (row, pages, context_len)
        logits_rows: list[int] = []
        sampled = []
        for chunk in output.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            q_start = len(input_ids)
            input_ids += seq.token_at(start, start + n)
            pos = range(start, start + n)
            positions += pos
            slot_blocks += [seq.block_table[p // bs] for p in pos]
            context_len = start + n
            num_pages = -(-context_len // bs)
            if n == 1:
                decoding.append((q_start, seq.block_table[:num_pages], context_len))
            else:
                # Only a chunk with cached context before it gathers pages; a fresh one attends to itself.
                pages = torch.tensor([seq.block_table[:num_pages] if start > 0 else []], dtype=torch.long)
                seqs.append(SeqAttention(q_start, n, context_len, self._rows(pages)))
            if chunk.sample:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        pos_t = torch.tensor(positions, dtype=torch.long)
        paged, groups = None, ()
        if self.attention_backend == "kernel":
            paged = self._paged(decoding)
        else:
            groups = self._decode_groups(decoding)
        meta = AttentionMetadata(
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long),
            slot_offsets=pos_t % bs,
            seqs=tuple(seqs),
            decode=groups,
            paged=paged,
            row_ops=paged is not None and self.kv_cache.tensor.dtype == torch.float32,
            workspace=self._workspace_for(max((a.kv_rows.numel() for a in (*seqs, *groups)), default=0)),
        )
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long),
            pos_t,
            meta,
            self.kv_cache.tensor,
            torch.tensor(logits_rows, dtype=torch.long),
        )
        if not sampled:
            return {}
        tokens, logprobs = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
        return {s.request_id: (t, lp) for s, t, lp in zip(sampled, tokens, logprobs, strict=False)}

    @staticmethod
    def _backend(requested: str, cache: torch.Tensor) -> str:
        if requested == "torch":
            return "torch"
        why_not = cpu_kernels.available(cache.dtype) if cache.device.type == "cpu" else "the cache is not on the CPU"
        if why_not is None:
            return "kernel"
        if requested == "kernel":
            raise ValueError(f"attention_backend 'kernel' is unavailable: {why_not}")
        log.warning("decode attention falls back to gathered pages + SDPA (slower)", reason=why_not)
        return "torch"

    @staticmethod
    def _paged(decoding: list[tuple[int, list[int], int]]) -> PagedDecode:
        width = max((len(p) for _, p, _ in decoding), default=0)
        # Rows are padded with page 0; the kernel reads only a row's first ceil(context / block) pages.
        tables = torch.tensor([p + [0] * (width - len(p)) for _, p, _ in decoding], dtype=torch.long)
        return PagedDecode(torch.tensor([r for r, _, _ in decoding], dtype=torch.long),
                           tables.view(len(decoding), width),
                           torch.tensor([c for _, _, c in decoding], dtype=torch.long))

    def _workspace_for(self, rows: int) -> torch.Tensor:
        """One scratch buffer for gathered pages, kept across steps (it only grows)."""
        if self._workspace.numel() < rows * self._row_numel:
            self._workspace = torch.empty(rows * self._row_numel, dtype=self._workspace.dtype)
        return self._workspace

    def _rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        return page_rows(block_ids, self._layers, self._kv_heads)

    def _decode_groups(self, decoding: list[tuple[int, list[int], int]]) -> tuple[DecodeGroup, ...]:
        """Longest first; a group closes when padding its members to its first (longest) would
        exceed MAX_PADDING times their real pages. Equal lengths make one group, no padding."""
        groups: list[DecodeGroup] = []
        members: list[tuple[int, list[int], int]] = []
        real = 0
        for d in sorted(decoding, key=lambda d: -len(d[1])):
            if members and len(members[0][1]) * (len(members) + 1) > MAX_PADDING * (real + len(d[1])):
                groups.append(self._decode_group(members))
                members, real = [], 0
            members.append(d)
            real += len(d[1])
        if members:
            groups.append(self._decode_group(members))
        return tuple(groups)

    def _decode_group(self, members: list[tuple[int, list[int], int]]) -> DecodeGroup:
        num_pages = len(members[0][1])
        # Padding pages repeat the sequence's first page; their slots are masked out.
        pages = [p + [p[0]] * (num_pages - len(p)) for _, p, _ in members]
        context = torch.tensor([c for _, _, c in members], dtype=torch.long)
        valid = torch.arange(num_pages * self.block_size).unsqueeze(0) < context.unsqueeze(1)
        return DecodeGroup(torch.tensor([r for r, _, _ in members], dtype=torch.long),
                           self._rows(torch.tensor(pages, dtype=torch.long)),
                           valid.view(len(members), 1, 1, -1))
