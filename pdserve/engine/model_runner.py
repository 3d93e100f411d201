"""Model runner: turns a `SchedulerOutput` into model inputs, runs the model, samples."""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.sampling import sample
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.model.llama import AttentionMetadata, DecodeBatch, SeqAttention, Transformer


class ModelRunner:
    """Runs one step. Reads sequences, writes only the KV cache pages it was given."""

    def __init__(self, model: Transformer, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> dict[str, tuple[int, float]]:
        """Returns {request_id: (token, logprob)} for the chunks that sample."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        seqs: list[SeqAttention] = []
        decode_rows: list[int] = []
        decode_pages: list[int] = []
        decode_page_seq: list[int] = []
        decode_last_fill: list[int] = []  # slots used in each sequence's last page
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
                decode_page_seq += [len(decode_rows)] * num_pages
                decode_rows.append(q_start)
                decode_pages += seq.block_table[:num_pages]
                decode_last_fill.append(context_len - (num_pages - 1) * bs)
            else:
                pages = torch.tensor(seq.block_table[:num_pages], dtype=torch.long)
                seqs.append(SeqAttention(q_start, n, context_len, pages))
            if chunk.sample:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        pos_t = torch.tensor(positions, dtype=torch.long)
        meta = AttentionMetadata(
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long),
            slot_offsets=pos_t % bs,
            seqs=tuple(seqs),
            decode=self._decode_batch(decode_rows, decode_pages, decode_page_seq, decode_last_fill),
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

    def _decode_batch(self, rows: list[int], pages: list[int], page_seq: list[int],
                      last_fill: list[int]) -> DecodeBatch | None:
        if not rows:
            return None
        page_seq_t = torch.tensor(page_seq, dtype=torch.long)
        # A page is full unless it is its sequence's last page (the next page has another owner).
        is_last = torch.ones(len(pages), dtype=torch.bool)
        is_last[:-1] = page_seq_t[1:] != page_seq_t[:-1]
        fill = torch.full((len(pages),), self.block_size, dtype=torch.long)
        fill[is_last] = torch.tensor(last_fill, dtype=torch.long)
        slot_valid = torch.arange(self.block_size).unsqueeze(0) < fill.unsqueeze(1)
        return DecodeBatch(torch.tensor(rows, dtype=torch.long), torch.tensor(pages, dtype=torch.long),
                           page_seq_t, slot_valid)
