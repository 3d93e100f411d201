"""Attention and row ops in plain torch, on any device: a sequence's K/V pages gathered into one
buffer, then SDPA.

Prompt chunks attend one sequence at a time. Decoding sequences attend in groups, each padded
(masked) only up to its longest member, within MAX_PADDING of the group's real pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kv.layout import KVLayout
from pdserve.model.attention import AttentionMetadata, SeqPages
from pdserve.model.rope import rotate

# A decode group takes another sequence only while its padded pages stay within this factor of its real pages.
MAX_PADDING = 1.25


def page_rows(block_ids: torch.Tensor, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """Rows of the cache viewed as [rows, block_size * head_dim] that hold layer 0's K and V of
    the pages `block_ids` [n, pages], in [2, n, kv_heads, pages] order (flattened). Layer l's rows
    are these plus l * 2 * kv_heads. Gathered in this order, K and V come out as
    [n, kv_heads, pages * block_size, head_dim] with no further copy."""
    base = (block_ids * (num_layers * 2 * num_kv_heads)).unsqueeze(1)  # [n, 1, pages]
    kv = torch.arange(2, device=block_ids.device).view(2, 1, 1, 1) * num_kv_heads
    head = torch.arange(num_kv_heads, device=block_ids.device).view(1, 1, num_kv_heads, 1)
    return (base.unsqueeze(0) + kv + head).reshape(-1)


@dataclass(frozen=True)
class SeqAttention:
    """A prompt chunk: where its new tokens sit in the flat batch, and its cache pages."""

    q_start: int
    q_len: int
    context_len: int
    kv_rows: torch.Tensor  # page_rows() of its pages (empty: nothing cached before this chunk)


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences with exactly one new token, attended in one call, each padded to the group's
    page count with masked slots."""

    rows: torch.Tensor  # [n] their rows in the flat token dimension
    kv_rows: torch.Tensor  # page_rows() of their pages, [n, num_pages]
    valid: torch.Tensor  # [n, 1, 1, num_pages * block_size] bool: the slot holds a context token


@dataclass(frozen=True)
class TorchPlan:
    seqs: tuple[SeqAttention, ...]  # prompt chunks
    decode: tuple[DecodeGroup, ...]


class TorchBackend:
    """Gathers pages and calls SDPA. Owns the scratch buffer gathered pages land in: reused by
    every layer and step, it only grows."""

    name = "torch"

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu"):
        self.block_size = layout.block_size
        self.num_layers = layout.num_layers
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = layout.head_dim
        self.device = torch.device(device)
        self._workspace = torch.empty(0, dtype=layout.torch_dtype, device=self.device)

    def plan(self, seqs: list[SeqPages]) -> TorchPlan:
        return TorchPlan(self.prompt_chunks(seqs), self.decode_groups([s for s in seqs if s.q_len == 1]))

    def prompt_chunks(self, seqs: list[SeqPages]) -> tuple[SeqAttention, ...]:
        # Only a chunk with cached context before it gathers pages; a fresh one attends to itself.
        return tuple(SeqAttention(s.q_start, s.q_len, s.context_len,
                                  self._rows([s.block_ids if s.q_len < s.context_len else []]))
                     for s in seqs if s.q_len > 1)

    def decode_groups(self, seqs: list[SeqPages]) -> tuple[DecodeGroup, ...]:
        """Longest first; a group closes when padding its members to its first (longest) would
        exceed MAX_PADDING times their real pages. Equal lengths make one group, no padding."""
        groups: list[DecodeGroup] = []
        members: list[SeqPages] = []
        real = 0
        for s in sorted(seqs, key=lambda s: -len(s.block_ids)):
            if members and len(members[0].block_ids) * (len(members) + 1) > MAX_PADDING * (real + len(s.block_ids)):
                groups.append(self._decode_group(members))
                members, real = [], 0
            members.append(s)
            real += len(s.block_ids)
        if members:
            groups.append(self._decode_group(members))
        return tuple(groups)

    def _decode_group(self, members: list[SeqPages]) -> DecodeGroup:
        num_pages = len(members[0].block_ids)
        # Padding pages repeat the sequence's first page; their slots are masked out.
        pages = [s.block_ids + [s.block_ids[0]] * (num_pages - len(s.block_ids)) for s in members]
        context = torch.tensor([s.context_len for s in members], device=self.device)
        valid = torch.arange(num_pages * self.block_size, device=self.device).unsqueeze(0) < context.unsqueeze(1)
        return DecodeGroup(torch.tensor([s.q_start for s in members], device=self.device), self._rows(pages),
                           valid.view(len(members), 1, 1, -1))

    def _rows(self, pages: list[list[int]]) -> torch.Tensor:
        return page_rows(torch.tensor(pages, dtype=torch.long, device=self.device), self.num_layers,
                         self.num_kv_heads)

    def write_kv(self, kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        layer_cache = kv_cache[:, layer]
        layer_cache[meta.slot_block_ids, 0, :, meta.slot_offsets] = k
        layer_cache[meta.slot_block_ids, 1, :, meta.slot_offsets] = v

    def prefill(self, kv_cache: torch.Tensor, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        if not meta.plan.seqs:
            return
        cache_rows = kv_cache.view(-1, self.block_size * self.head_dim)
        for s in meta.plan.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._attend(q[rows], k[rows], v[rows], s, cache_rows, layer, scale)

    def decode(self, kv_cache: torch.Tensor, layer: int, q: torch.Tensor, out: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> None:
        if not meta.plan.decode:
            return
        cache_rows = kv_cache.view(-1, self.block_size * self.head_dim)
        for g in meta.plan.decode:
            k, v = self._gather(cache_rows, g.kv_rows, layer, g.rows.numel())  # [n, kv_heads, pages * bs, D]
            o = F.scaled_dot_product_attention(q[g.rows].unsqueeze(2), k, v, attn_mask=g.valid, scale=scale,
                                               enable_gqa=True)
            out[g.rows] = o.squeeze(2)

    def _gather(self, cache_rows: torch.Tensor, kv_rows: torch.Tensor, layer: int, n: int):
        # One copy: K and V of n sequences' pages as [n, kv_heads, pages * block_size, head_dim].
        rows = kv_rows + layer * 2 * self.num_kv_heads  # see page_rows()
        if self._workspace.numel() < rows.numel() * cache_rows.shape[1]:
            self._workspace = torch.empty(rows.numel() * cache_rows.shape[1], dtype=cache_rows.dtype,
                                          device=cache_rows.device)
        kv = self._workspace[: rows.numel() * cache_rows.shape[1]].view(-1, cache_rows.shape[1])
        torch.index_select(cache_rows, 0, rows, out=kv)
        kv = kv.view(2, n, self.num_kv_heads, -1, self.head_dim)
        return kv[0], kv[1]

    def _attend(self, q, k_new, v_new, s: SeqAttention, cache_rows: torch.Tensor, layer: int,
                scale: float) -> torch.Tensor:
        # q: [q_len, heads, head_dim] -> [q_len, heads, head_dim]
        if s.q_len == s.context_len:
            # Nothing cached before this chunk: attend to the fresh K/V, no page gather.
            k = k_new.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
            v = v_new.transpose(0, 1).unsqueeze(0)
        else:
            k, v = self._gather(cache_rows, s.kv_rows, layer, 1)
            k, v = k[:, :, : s.context_len], v[:, :, : s.context_len]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        mask = None
        if s.q_len < s.context_len:
            # Query i sits at absolute position (context_len - q_len + i).
            q_pos = torch.arange(s.context_len - s.q_len, s.context_len, device=q.device).unsqueeze(1)
            mask = torch.arange(s.context_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, ctx]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)


class TorchOps:
    """The row ops as torch computes them (any dtype, any device)."""

    def linear(self, mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return mod(x)

    def rotate(self, qk: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return rotate(qk, cos_sin)

    def add_norm(self, norm: nn.Module, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[
            torch.Tensor, torch.Tensor]:
        residual = h if residual is None else residual + h
        return norm(residual), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def decoder(self, layers: nn.ModuleList, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = None
        for layer in layers:
            h, residual = layer(h, residual, cos_sin, meta, kv_cache)
        return h, residual
