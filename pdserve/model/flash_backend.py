"""Attention on CUDA through the FlashAttention kernels bundled with torch: every sequence of a
step, prompt chunks and decodes alike, in one `varlen_attn` call per layer that reads K/V from
the cache's pages through a block table (no gather, no padding).

The cache's pages are [kv_heads, block_size, head_dim] per layer and K/V; FlashAttention wants
[page_size, kv_heads, head_dim], which is a strided view of the same memory (only head_dim must
be contiguous). Its paged-KV path sets the constraints `unavailable` checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kv.layout import KVLayout
from pdserve.model.attention import AttentionMetadata, SeqPages
from pdserve.model.torch_backend import TorchBackend

FLASH_DTYPES = (torch.float16, torch.bfloat16)
PAGE_MULTIPLE = 256  # FlashAttention 2's paged KV takes pages of a multiple of 256 tokens


def unavailable(layout: KVLayout, device: torch.device) -> str | None:
    """None when this backend can serve a cache of this layout on this device; otherwise which
    constraint does not fit."""
    if device.type != "cuda":
        return "FlashAttention runs on CUDA only"
    if layout.torch_dtype not in FLASH_DTYPES:
        return f"FlashAttention takes float16 or bfloat16, the model runs {layout.torch_dtype}"
    if layout.block_size % PAGE_MULTIPLE:
        return (f"FlashAttention's paged KV needs pages of a multiple of {PAGE_MULTIPLE} tokens, the block size "
                f"is {layout.block_size} (--block-size {PAGE_MULTIPLE} fits)")
    if layout.head_dim % 8 or layout.head_dim > 256:
        return f"FlashAttention takes head_dim a multiple of 8 up to 256, got {layout.head_dim}"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no FlashAttention kernels"
    return None


@dataclass(frozen=True)
class FlashPlan:
    cu_seq_q: torch.Tensor  # [N + 1] int32: where each sequence's rows start in the flat batch
    cu_seq_k: torch.Tensor  # [N + 1] int32: running sum of context lengths
    seqused_k: torch.Tensor  # [N] int32: tokens in cache per sequence, this step's included
    block_table: torch.Tensor  # [N, max_pages] int32
    max_q: int
    max_k: int


class FlashBackend(TorchBackend):
    """Writes K/V as TorchBackend does; attends every sequence in `prefill` (`decode` has nothing
    left to do)."""

    name = "flash"

    def __init__(self, layout: KVLayout, device: torch.device):
        super().__init__(layout, device)
        from torch.nn.attention.varlen import varlen_attn

        self._varlen_attn = varlen_attn

    def plan(self, seqs: list[SeqPages]) -> FlashPlan:
        width = max(len(s.block_ids) for s in seqs)
        as_i32 = dict(dtype=torch.int32, device=self.device)
        q_lens = [s.q_len for s in seqs]
        k_lens = [s.context_len for s in seqs]
        return FlashPlan(
            cu_seq_q=torch.tensor([0, *q_lens], **as_i32).cumsum(0, dtype=torch.int32),
            cu_seq_k=torch.tensor([0, *k_lens], **as_i32).cumsum(0, dtype=torch.int32),
            seqused_k=torch.tensor(k_lens, **as_i32),
            # Rows padded with page 0: the kernel reads only a row's first ceil(seqused_k / page) pages.
            block_table=torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs], **as_i32),
            max_q=max(q_lens), max_k=max(k_lens))

    def prefill(self, kv_cache: torch.Tensor, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        p: FlashPlan = meta.plan
        pages = kv_cache[:, layer].transpose(2, 3)  # [num_blocks, 2, block_size, kv_heads, head_dim]
        # Causal masks align bottom-right: query i of a chunk sees the context up to its own position.
        out.copy_(self._varlen_attn(q, pages[:, 0], pages[:, 1], p.cu_seq_q, p.cu_seq_k, p.max_q, p.max_k,
                                    scale=scale, window_size=(-1, 0), enable_gqa=True, seqused_k=p.seqused_k,
                                    block_table=p.block_table))

    def decode(self, kv_cache: torch.Tensor, layer: int, q: torch.Tensor, out: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> None:
        return  # attended with the prompt chunks, in `prefill`
