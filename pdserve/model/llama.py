"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged, block-major KV cache.

Read top to bottom: attention metadata → Transformer → Block → Attention → MLP → RMSNorm.
The KV cache is one tensor [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
(a block's KV for every layer is one contiguous slab, see DESIGN.md). Tokens of all
sequences in a step are flattened into one dimension T, never padded. Prompt chunks attend one
sequence at a time. Decoding sequences attend either through the C kernel, which reads their
pages in place (`paged`), or, where it is not built, in groups of gathered pages, each padded
(masked) only up to its longest member, within 1.25x of the group's real pages (`decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import cpu_kernels
from pdserve.model.config import ModelConfig
from pdserve.model.rope import RotaryEmbedding, rotate


def page_rows(block_ids: torch.Tensor, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """Rows of the cache viewed as [rows, block_size * head_dim] that hold layer 0's K and V of
    the pages `block_ids` [n, pages], in [2, n, kv_heads, pages] order (flattened). Layer l's rows
    are these plus l * 2 * kv_heads. Gathered in this order, K and V come out as
    [n, kv_heads, pages * block_size, head_dim] with no further copy."""
    base = (block_ids * (num_layers * 2 * num_kv_heads)).unsqueeze(1)  # [n, 1, pages]
    kv = torch.arange(2).view(2, 1, 1, 1) * num_kv_heads
    head = torch.arange(num_kv_heads).view(1, 1, num_kv_heads, 1)
    return (base.unsqueeze(0) + kv + head).reshape(-1)


@dataclass(frozen=True)
class SeqAttention:
    """Where one sequence's new tokens sit in the flat batch, and its cache pages."""

    q_start: int  # first row of this sequence in the flat token dimension
    q_len: int  # new tokens this step
    context_len: int  # tokens in cache after this step (cached + new)
    kv_rows: torch.Tensor  # page_rows() of its ceil(context_len / block_size) pages (empty: nothing cached)


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences with exactly one new token, attended in one call. Each is padded to the group's
    page count with masked slots; the runner groups sequences so that padding stays bounded."""

    rows: torch.Tensor  # [n] their rows in the flat token dimension
    kv_rows: torch.Tensor  # page_rows() of their pages, [n, num_pages]
    valid: torch.Tensor  # [n, 1, 1, num_pages * block_size] bool: the slot holds a context token


@dataclass(frozen=True)
class PagedDecode:
    """Sequences with exactly one new token, attended by the C kernel straight from their pages:
    no gather, no padding (cpu_kernels.paged_decode)."""

    rows: torch.Tensor  # [n] their rows in the flat token dimension
    block_tables: torch.Tensor  # [n, max_pages] int64 page ids (a row's tail beyond its pages is unread)
    context_lens: torch.Tensor  # [n] int64 tokens in cache, the new one included


@dataclass(frozen=True)
class AttentionMetadata:
    slot_block_ids: torch.Tensor  # [T] page receiving each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that page
    seqs: tuple[SeqAttention, ...]  # sequences attended one by one (prompt chunks)
    decode: tuple[DecodeGroup, ...] = ()
    paged: PagedDecode | None = None  # set (maybe with no rows) when the C kernel does decode attention
    row_ops: bool = False  # norms and RoPE as C row ops (float32 on CPU)
    # Scratch for gathered pages, reused by every layer (None: allocate per gather).
    workspace: torch.Tensor | None = None


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, kv_heads, block_size, head_dim]
        logits_indices: torch.Tensor,  # [S] rows whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        h = self.embed(input_ids)  # [T, hidden]
        cos_sin = self.rope.at(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos_sin, meta, kv_cache)
        x = self.norm((residual + h)[logits_indices])
        return linear(self.lm_head, x, meta.row_ops).float()


def linear(mod: nn.Linear, x: torch.Tensor, row_ops: bool) -> torch.Tensor:
    """mod(x); a decode step's few float32 rows take the small-batch GEMM (see cpu_kernels.linear)."""
    if row_ops and x.shape[0] <= cpu_kernels.SMALL_GEMM_MAX_ROWS and cpu_kernels.small_gemm_available():
        return cpu_kernels.linear(x, mod.weight, mod.bias)
    return mod(x)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, residual, cos_sin, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output, the residual stream before it): the caller's next norm adds them."""
        h, residual = self.attn_norm.add_norm(h, residual, meta.row_ops)
        h = self.attn(h, cos_sin, meta, kv_cache)
        h, residual = self.mlp_norm.add_norm(h, residual, meta.row_ops)
        return self.mlp(h, meta.row_ops), residual


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.wqkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.wo = nn.Linear(q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim ** -0.5
        self.row_offset = layer_idx * 2 * config.num_kv_heads  # see page_rows()

    def forward(self, x, cos_sin, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        # kv_cache: [num_blocks, num_layers, 2, kv_heads, block_size, head_dim]
        num_tokens = x.shape[0]
        q_size, kv_size, _ = self.split
        qkv = linear(self.wqkv, x, meta.row_ops)
        # q and k lie side by side in qkv: rotate them in one go. [T, heads + kv_heads, head_dim]
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim)
        if meta.row_ops:
            cpu_kernels.rope_(qk, *cos_sin)
        else:
            qk = rotate(qk, cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        # Write the new tokens' K/V into their pages: [T, kv_heads, head_dim] each.
        if meta.paged is not None:
            cpu_kernels.write_kv(kv_cache, k, v, meta.slot_block_ids, meta.slot_offsets, self.layer_idx)
        else:
            layer_cache = kv_cache[:, self.layer_idx]
            layer_cache[meta.slot_block_ids, 0, :, meta.slot_offsets] = k
            layer_cache[meta.slot_block_ids, 1, :, meta.slot_offsets] = v
        p = meta.paged
        kernel = p is not None and p.rows.numel() > 0
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=torch.float32 if kernel else x.dtype)
        if kernel:
            cpu_kernels.paged_decode(kv_cache, q.float(), out, p.rows, p.block_tables, p.context_lens,
                                     self.layer_idx, self.scale)
            out = out.to(x.dtype)
        cache_rows = kv_cache.view(-1, kv_cache.shape[-2] * self.head_dim)  # for the gathers below
        for g in meta.decode:
            out[g.rows] = self._attend_decode(q[g.rows], g, cache_rows, meta.workspace)
        for s in meta.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._attend(q[rows], k[rows], v[rows], s, cache_rows, meta.workspace)
        return linear(self.wo, out.view(num_tokens, self.num_heads * self.head_dim), meta.row_ops)

    def _gather(self, cache_rows: torch.Tensor, kv_rows: torch.Tensor, n: int, workspace: torch.Tensor | None):
        # One copy: K and V of n sequences' pages as [n, kv_heads, pages * block_size, head_dim].
        rows = kv_rows + self.row_offset
        if workspace is None:
            kv = torch.index_select(cache_rows, 0, rows)
        else:
            kv = workspace[: rows.numel() * cache_rows.shape[1]].view(-1, cache_rows.shape[1])
            torch.index_select(cache_rows, 0, rows, out=kv)
        kv = kv.view(2, n, self.num_kv_heads, -1, self.head_dim)
        return kv[0], kv[1]

    def _attend(self, q, k_new, v_new, s: SeqAttention, cache_rows: torch.Tensor, workspace) -> torch.Tensor:
        # q: [q_len, heads, head_dim] -> [q_len, heads, head_dim]
        if s.q_len == s.context_len:
            # Nothing cached before this chunk: attend to the fresh K/V, no page gather.
            k = k_new.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
            v = v_new.transpose(0, 1).unsqueeze(0)
        else:
            k, v = self._gather(cache_rows, s.kv_rows, 1, workspace)
            k, v = k[:, :, : s.context_len], v[:, :, : s.context_len]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        mask = None
        is_causal = False
        if s.q_len > 1:
            if s.q_len == s.context_len:
                is_causal = True
            else:
                # Query i sits at absolute position (context_len - q_len + i).
                q_pos = torch.arange(s.context_len - s.q_len, s.context_len).unsqueeze(1)
                mask = torch.arange(s.context_len).unsqueeze(0) <= q_pos  # [q_len, ctx]
        o = F.scaled_dot_product_attention(
            qh, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=True
        )
        return o[0].transpose(0, 1)

    def _attend_decode(self, q: torch.Tensor, g: DecodeGroup, cache_rows: torch.Tensor, workspace) -> torch.Tensor:
        # q: [n, heads, head_dim] -> [n, heads, head_dim]; one query per sequence.
        k, v = self._gather(cache_rows, g.kv_rows, q.shape[0], workspace)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=g.valid, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, row_ops: bool = False) -> torch.Tensor:
        gate, up = linear(self.w_gate_up, x, row_ops).split(self.intermediate_size, dim=-1)
        return linear(self.w_down, F.silu(gate) * up, row_ops)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as HF does, so bf16 matches.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(self, h: torch.Tensor, residual: torch.Tensor | None, row_ops: bool) -> tuple[
            torch.Tensor, torch.Tensor]:
        """residual += h (residual None: h starts the stream), then (norm(residual), residual).
        row_ops: one C pass, adding in place into the residual stream."""
        if row_ops:
            if residual is None:
                return cpu_kernels.add_rms_norm(h, None, self.weight, self.eps), h
            return cpu_kernels.add_rms_norm(residual, h, self.weight, self.eps), residual
        residual = h if residual is None else residual + h
        return self(residual), residual
