"""The seam between the model and whatever computes its attention and row ops.

The model (llama.py) calls only the two Protocols here; the runner picks their implementations
(pdserve/model/torch_backend.py: torch on any device; pdserve/model/kernel_backend.py: the C
kernels on the CPU) and hands them over in each step's `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class SeqPages:
    """One sequence's share of a step, as the runner sees it."""

    q_start: int  # first row of its new tokens in the flat token dimension
    q_len: int  # new tokens this step (1: a decoding sequence)
    context_len: int  # tokens in cache after this step (cached + new)
    block_ids: list[int]  # its first ceil(context_len / block_size) pages


class AttentionBackend(Protocol):
    """Attention over the paged KV cache [num_blocks, num_layers, 2, kv_heads, block_size, head_dim].

    q, k, v, out are the step's flat rows: q and out [T, heads, head_dim], k and v
    [T, kv_heads, head_dim]; rows may be strided views of one qkv buffer."""

    name: str  # "torch", "kernel" or "flash", as EngineConfig.attention_backend names it

    def plan(self, seqs: list[SeqPages]) -> Any:
        """Once a step, before the forward: what this backend's verbs below need to know of the
        step's sequences (it reads back only its own plan, as `meta.plan`)."""

    def write_kv(self, kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """This layer's new K/V rows into their slots: meta.slot_block_ids, meta.slot_offsets."""

    def prefill(self, kv_cache: torch.Tensor, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        """Causal attention of every prompt chunk (q_len > 1) over its context, into its rows of out."""

    def decode(self, kv_cache: torch.Tensor, layer: int, q: torch.Tensor, out: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> None:
        """Attention of every one-token sequence over its pages, into its row of out."""


class RowOps(Protocol):
    """The decoder layer's dense ops on [T, dim] rows, apart from attention."""

    def linear(self, mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """mod(x)."""

    def rotate(self, qk: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """qk [T, heads, head_dim] rotated by position (rope.rotate); it may be rotated in place."""

    def add_norm(self, norm: nn.Module, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[
            torch.Tensor, torch.Tensor]:
        """residual += h (residual None: h starts the stream), then (norm(residual), residual);
        h or residual may be updated in place."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 * intermediate] = [gate | up]."""

    def decoder(self, layers: nn.ModuleList, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer (llama.Block) in turn over the embedded tokens h: (the last layer's
        output, the residual stream before it)."""


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's forward, besides its tokens: who computes attention and the row ops, and where
    the new tokens' K/V go. Built by the runner; the model passes it on to the backend unread."""

    backend: AttentionBackend
    ops: RowOps
    slot_block_ids: torch.Tensor  # [T] page receiving each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that page
    plan: Any  # backend.plan() of the step's sequences
