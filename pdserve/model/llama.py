"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged, block-major KV cache.

Read top to bottom: attention metadata → Transformer → Block → Attention → MLP → RMSNorm.
The KV cache is one tensor [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
(a block's KV for every layer is one contiguous slab, see DESIGN.md). Tokens of all
sequences in a step are flattened into one dimension T; no padding across sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.config import ModelConfig
from pdserve.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class SeqAttention:
    """Where one sequence's new tokens sit in the flat batch, and its cache pages."""

    q_start: int  # first row of this sequence in the flat token dimension
    q_len: int  # new tokens this step
    context_len: int  # tokens in cache after this step (cached + new)
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with exactly one new token, attended together page by page (no padding)."""

    rows: torch.Tensor  # [B] their rows in the flat token dimension
    page_ids: torch.Tensor  # [P] every page of every such sequence, sequence after sequence
    page_seq: torch.Tensor  # [P] index (0..B-1) of the sequence owning each page
    slot_valid: torch.Tensor  # [P, block_size] bool: the slot holds a token of the context


@dataclass(frozen=True)
class AttentionMetadata:
    slot_block_ids: torch.Tensor  # [T] page receiving each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that page
    seqs: tuple[SeqAttention, ...]  # sequences attended one by one (prompt chunks)
    decode: DecodeBatch | None = None


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
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
        x = self.embed(input_ids)  # [T, hidden]
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, positions, meta, kv_cache[:, layer_idx], self.rope)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, positions, meta, layer_cache, rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, meta, layer_cache, rope)
        return x + self.mlp(self.mlp_norm(x))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.wqkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.wo = nn.Linear(q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim ** -0.5

    def forward(self, x, positions, meta: AttentionMetadata, layer_cache, rope) -> torch.Tensor:
        # layer_cache: [num_blocks, 2, kv_heads, block_size, head_dim] (a view into the cache)
        num_tokens = x.shape[0]
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(q, k, positions)
        # Write the new tokens' K/V into their pages: [T, kv_heads, head_dim] each.
        layer_cache[meta.slot_block_ids, 0, :, meta.slot_offsets] = k
        layer_cache[meta.slot_block_ids, 1, :, meta.slot_offsets] = v
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=x.dtype)
        if meta.decode is not None:
            out[meta.decode.rows] = self._attend_decode(q[meta.decode.rows], meta.decode, layer_cache)
        for s in meta.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._attend(q[rows], k[rows], v[rows], s, layer_cache)
        return self.wo(out.view(num_tokens, self.num_heads * self.head_dim))

    def _attend(self, q, k_new, v_new, s: SeqAttention, layer_cache: torch.Tensor) -> torch.Tensor:
        # q: [q_len, heads, head_dim] -> [q_len, heads, head_dim]
        if s.q_len == s.context_len:
            # Nothing cached before this chunk: attend to the fresh K/V, no page gather.
            k = k_new.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
            v = v_new.transpose(0, 1).unsqueeze(0)
        else:
            pages = torch.index_select(layer_cache, 0, s.block_ids)  # [pages, 2, kv_heads, block_size, head_dim]
            kv = pages.permute(1, 2, 0, 3, 4).reshape(2, self.num_kv_heads, -1, self.head_dim)
            k = kv[0, :, : s.context_len].unsqueeze(0)
            v = kv[1, :, : s.context_len].unsqueeze(0)
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

    def _attend_decode(self, q: torch.Tensor, d: DecodeBatch, layer_cache: torch.Tensor) -> torch.Tensor:
        # q: [B, heads, head_dim] -> [B, heads, head_dim]. A softmax over each sequence's pages,
        # computed page-wise and combined with segment max/sum, so no sequence is padded.
        num_seqs, group = q.shape[0], self.num_heads // self.num_kv_heads
        # Gather K and V pages separately so each is contiguous [P, kv_heads, block_size, head_dim].
        k = torch.index_select(layer_cache[:, 0], 0, d.page_ids).float()
        v = torch.index_select(layer_cache[:, 1], 0, d.page_ids).float()
        qg = q.float().view(num_seqs, self.num_kv_heads, group, self.head_dim)[d.page_seq]  # [P, kvh, G, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale  # [P, kvh, G, block_size]
        scores.masked_fill_(~d.slot_valid[:, None, None, :], float("-inf"))
        page_max = scores.amax(-1)  # [P, kvh, G]
        seq_max = torch.full((num_seqs, self.num_kv_heads, group), float("-inf")).scatter_reduce(
            0, d.page_seq[:, None, None].expand_as(page_max), page_max, "amax")
        e = torch.exp(scores - seq_max[d.page_seq].unsqueeze(-1))
        denom = torch.zeros(num_seqs, self.num_kv_heads, group).index_add_(0, d.page_seq, e.sum(-1))
        num = torch.zeros(num_seqs, self.num_kv_heads, group, self.head_dim).index_add_(
            0, d.page_seq, torch.matmul(e, v))
        return (num / denom.unsqueeze(-1)).view(num_seqs, self.num_heads, self.head_dim).to(q.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.intermediate_size, dim=-1)
        return self.w_down(F.silu(gate) * up)


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
