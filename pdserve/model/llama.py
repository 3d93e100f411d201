"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged, block-major KV cache.

Read top to bottom: Transformer → Block → Attention → MLP → RMSNorm. The KV cache is one tensor
[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] (a block's KV for every layer is
one contiguous slab, see DESIGN.md). Tokens of all sequences in a step are flattened into one
dimension T, never padded. Attention over the cache and the row ops (linears, RoPE, residual add +
RMSNorm) are computed by whatever the step's AttentionMetadata names (pdserve/model/attention.py):
the model does not know which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionMetadata
from pdserve.model.config import ModelConfig
from pdserve.model.rope import RotaryEmbedding


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
        logits_indices: torch.Tensor | None,  # [S] rows whose next-token logits are wanted; None: all
    ) -> torch.Tensor:  # [S, vocab] float32
        h = self.embed(input_ids)  # [T, hidden]
        cos_sin = self.rope.at(positions, h.dtype)
        h, residual = meta.ops.decoder(self.layers, h, cos_sin, meta, kv_cache)
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        x, _ = meta.ops.add_norm(self.norm, h, residual)
        return meta.ops.linear(self.lm_head, x).float()


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, residual, cos_sin, meta: AttentionMetadata, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output, the residual stream before it): the caller's next norm adds them."""
        h, residual = meta.ops.add_norm(self.attn_norm, h, residual)
        h = self.attn(h, cos_sin, meta, kv_cache)
        h, residual = meta.ops.add_norm(self.mlp_norm, h, residual)
        return self.mlp(h, meta), residual


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
        self.wo = nn.Linear(q_size, config.hidden_size, bias=config.attention_out_bias)
        self.scale = config.head_dim ** -0.5

    def forward(self, x, cos_sin, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        # kv_cache: [num_blocks, num_layers, 2, kv_heads, block_size, head_dim]
        num_tokens = x.shape[0]
        q_size, kv_size, _ = self.split
        qkv = meta.ops.linear(self.wqkv, x)
        # q and k lie side by side in qkv: rotate them in one go. [T, heads + kv_heads, head_dim]
        qk = meta.ops.rotate(qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim), cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        backend = meta.backend
        backend.write_kv(kv_cache, self.layer_idx, k, v, meta)  # the new tokens' K/V into their pages
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        backend.prefill(kv_cache, self.layer_idx, q, k, v, out, meta, self.scale)
        backend.decode(kv_cache, self.layer_idx, q, out, meta, self.scale)
        return meta.ops.linear(self.wo, out.view(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return meta.ops.linear(self.w_down, meta.ops.silu_mul(meta.ops.linear(self.w_gate_up, x)))


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
