"""Attention and row ops through the C kernels (cpu_kernels), on the CPU.

Decode attention reads each sequence's pages in place: no gather, no padding. Prompt chunks
attend as in TorchBackend. The row ops are the ones `pdserve bench row-ops` shows paying against
eager torch and torch.compile: the small-batch GEMM, RMSNorm fused with the residual add, RoPE;
and SiLU-and-multiply, so that a step whose every row decodes can run the whole decoder stack
through these kernels in one C call, with the bits of the layer-by-layer path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.model import cpu_kernels, packed_linear
from pdserve.model.attention import AttentionMetadata, SeqPages
from pdserve.model.torch_backend import SeqAttention, TorchBackend, TorchOps


def unavailable(cache: torch.Tensor) -> str | None:
    """None when the kernels serve this cache here; otherwise why not."""
    if cache.device.type != "cpu":
        return "the cache is not on the CPU"
    return cpu_kernels.available(cache.dtype)


@dataclass(frozen=True)
class PagedDecode:
    """Sequences with exactly one new token, for cpu_kernels.paged_decode."""

    rows: torch.Tensor  # [n] their rows in the flat token dimension
    block_tables: torch.Tensor  # [n, max_pages] int64 page ids (a row's tail beyond its pages is unread)
    context_lens: torch.Tensor  # [n] int64 tokens in cache, the new one included


@dataclass(frozen=True)
class KernelPlan:
    seqs: tuple[SeqAttention, ...]  # prompt chunks, attended by TorchBackend.prefill
    paged: PagedDecode | None  # None: no sequence decodes this step


class CpuKernelBackend(TorchBackend):
    """C KV write and C decode attention; needs a contiguous CPU cache (see `unavailable`)."""

    name = "kernel"

    def plan(self, seqs: list[SeqPages]) -> KernelPlan:
        decoding = [s for s in seqs if s.q_len == 1]
        if not decoding:
            return KernelPlan(self.prompt_chunks(seqs), None)
        width = max(len(s.block_ids) for s in decoding)
        # Rows are padded with page 0; the kernel reads only a row's first ceil(context / block) pages.
        tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in decoding], dtype=torch.long)
        paged = PagedDecode(torch.tensor([s.q_start for s in decoding], dtype=torch.long), tables,
                            torch.tensor([s.context_len for s in decoding], dtype=torch.long))
        return KernelPlan(self.prompt_chunks(seqs), paged)

    def write_kv(self, kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        cpu_kernels.write_kv(kv_cache, k, v, meta.slot_block_ids, meta.slot_offsets, layer)

    def decode(self, kv_cache: torch.Tensor, layer: int, q: torch.Tensor, out: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> None:
        p: PagedDecode | None = meta.plan.paged
        if p is None:
            return
        # The kernel reads and writes float32 rows; other dtypes go through a float32 copy.
        o = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
        cpu_kernels.paged_decode(kv_cache, q.float(), o, p.rows, p.block_tables, p.context_lens, layer, scale)
        if o is not out:
            out[p.rows] = o[p.rows].to(out.dtype)


class CpuKernelOps(TorchOps):
    """The C row ops, float32 only (the runner picks them for float32 models only). Linears of up
    to SMALL_GEMM_MAX_ROWS rows (decode steps) take the C GEMM, longer ones (prompt chunks) oneDNN
    over the same row-major weight where that is the faster library (`prompt_linear_by_onednn`);
    linears reordered for oneDNN, and decode rows on CPUs without AVX-512 or AVX2, stay the
    module's own."""

    def __init__(self) -> None:
        self._small_gemm = cpu_kernels.small_gemm_available()
        self._onednn = packed_linear.prompt_linear_by_onednn()

    def linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # A PackedLinear (EngineConfig.linear_weights) has no row-major weight for the C GEMM.
        if type(mod) is not nn.Linear:
            return mod(x)
        if x.shape[0] <= cpu_kernels.SMALL_GEMM_MAX_ROWS:
            return cpu_kernels.linear(x, mod.weight, mod.bias) if self._small_gemm else mod(x)
        if self._onednn:
            return packed_linear.onednn_linear(x, mod.weight, mod.bias)  # (prompt chunks, where it is faster)
        return mod(x)

    def rotate(self, qk: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cpu_kernels.rope_(qk, *cos_sin)
        return qk

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_mul(gate_up)

    def decoder(self, layers: nn.ModuleList, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step whose every row decodes runs all the layers in one C call (cpu_kernels.decode_layers):
        the kernels this class and CpuKernelBackend call one by one, in the same order, so the same
        bits, without the Python between them. Other steps, and weights that are not row-major
        (packed for oneDNN), go layer by layer. (The runner pairs these ops with CpuKernelBackend
        only, so meta.plan is its KernelPlan.)"""
        paged: PagedDecode | None = meta.plan.paged
        m = h.shape[0]
        if self._small_gemm and paged is not None and not meta.plan.seqs and paged.rows.numel() == m \
                and m <= cpu_kernels.SMALL_GEMM_MAX_ROWS:
            weights = _WEIGHTS.get(layers)
            if weights is not None:
                attn, norm = layers[0].attn, layers[0].attn_norm
                shape = cpu_kernels.DecoderShape(h.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                 layers[0].mlp.intermediate_size, norm.eps, attn.scale)
                out = cpu_kernels.decode_layers(weights, shape, h, *cos_sin, kv_cache, meta.slot_block_ids,
                                                meta.slot_offsets, paged.block_tables, paged.context_lens)
                return out, h
        return super().decoder(layers, h, cos_sin, meta, kv_cache)

    def add_norm(self, norm: nn.Module, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[
            torch.Tensor, torch.Tensor]:
        # One C pass, adding in place into the residual stream.
        if residual is None:
            return cpu_kernels.add_rms_norm(h, None, norm.weight, norm.eps), h
        return cpu_kernels.add_rms_norm(residual, h, norm.weight, norm.eps), residual



# Each model's decoder layers -> their weights' data pointers [layers, 7] for decode_layers, while
# every one is a row-major float32 tensor. Written only by `weights_placed`.
_WEIGHTS: weakref.WeakKeyDictionary[nn.ModuleList, torch.Tensor] = weakref.WeakKeyDictionary()


def weights_placed(layers: nn.ModuleList) -> None:
    """Records where the decoder layers' weights lie now. Called by model_runner.place_linear_weights,
    the one place a model's linear weights are packed, unpacked or moved, each time it has placed
    them: a pointer table read afresh each step would cost 0.2 ms a step at 8 layers."""
    ptrs: list[int] = []
    for layer in layers:
        attn, mlp = layer.attn, layer.mlp
        if any(type(lin) is not nn.Linear for lin in (attn.wqkv, attn.wo, mlp.w_gate_up, mlp.w_down)) \
                or any(lin.bias is not None for lin in (attn.wo, mlp.w_gate_up, mlp.w_down)):  # (C: wqkv's only)
            _WEIGHTS.pop(layers, None)
            return
        for t in (layer.attn_norm.weight, attn.wqkv.weight, attn.wqkv.bias, attn.wo.weight, layer.mlp_norm.weight,
                  mlp.w_gate_up.weight, mlp.w_down.weight):
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"):
                _WEIGHTS.pop(layers, None)
                return
            ptrs.append(0 if t is None else t.data_ptr())
    _WEIGHTS[layers] = torch.tensor(ptrs, dtype=torch.long).view(len(layers), len(cpu_kernels.LAYER_WEIGHTS))
