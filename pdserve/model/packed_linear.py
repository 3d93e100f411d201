"""Linear layers whose weights oneDNN reordered once, at load, into its own blocked layout.

torch's `F.linear` on the CPU hands oneDNN or MKL a row-major weight on every call, and a
decode step's few rows then stream it at a fraction of the cores' FMA rate. A weight reordered
once (`torch.ops.mkldnn._reorder_linear_weight`, the op Inductor's CPU freezing pass uses) is
read by oneDNN's GEMM as it is laid out, for any number of rows: prompt chunks and decode steps
alike. The reordered tensor replaces the plain one, so the model still holds one copy of its
weights. What it bought, against torch and the C small-batch kernel: docs/perf-log.md, S24 and S26.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pdserve.native import cpu_vendor

# oneDNN picks the blocked layout for this many rows; the layout serves any row count.
BATCH_HINT = 16
# "auto" packs a linear of at least this many weights: below it (the tiny model's 256-wide
# layers) oneDNN's per-call cost outweighs its reads, and the plain path was faster (docs/perf-log.md, S26).
AUTO_MIN_WEIGHTS = 1 << 20
DTYPES = (torch.float32, torch.bfloat16)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when this torch can reorder and run linears of `dtype` on `device`; otherwise why not."""
    if device.type != "cpu":
        return f"oneDNN's reordered linears run on the CPU, not {device.type}"
    if dtype not in DTYPES:
        return f"oneDNN's reordered linears are built here for float32 and bfloat16, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch was built without oneDNN (mkldnn)"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 instructions oneDNN uses"
    return None


@functools.cache
def prompt_linear_by_onednn() -> bool:
    """Whether a prompt chunk's linear over a row-major weight goes to oneDNN rather than torch's
    default (MKL): on AMD CPUs MKL took 15% longer (docs/perf-log.md, S31); on Intel CPUs, where
    MKL runs its own code paths, oneDNN took 1-7% longer (S38)."""
    if unavailable(torch.device("cpu"), torch.float32) is not None:
        return False
    return not (torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) by oneDNN's GEMM, with the weight reordered (`PackedLinear.packed`) or
    row-major (nn.Linear's own)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`nn.Linear`'s job with the weight in oneDNN's layout. `state_dict()` gives the plain weight
    back, bit-exact, so baselines and fingerprints read what was loaded."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)

    def unpacked(self) -> nn.Linear:
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
        plain.bias = self.bias
        return plain

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.packed.to_dense()

    def _apply(self, fn, recurse=True):
        # .to(device) and friends: the reordered weight lives on the CPU only.
        probe = fn(torch.empty(0, dtype=self.dtype))
        if probe.device.type != "cpu" or probe.dtype != self.dtype:
            raise ValueError(f"a oneDNN-reordered linear stays {self.dtype} on the CPU; cannot move it to "
                             f"{probe.dtype} on {probe.device}")
        return super()._apply(fn, recurse)


def pack_linears(model: nn.Module, min_weights: int = 0) -> int:
    """Replaces each `nn.Linear` of `model` with at least `min_weights` weights by a PackedLinear,
    in place; smaller ones are unpacked. A head tied to the embedding stays plain: the embedding
    reads the same tensor. Returns how many linears are packed now."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def swap(m: nn.Module) -> nn.Module:
        if isinstance(m, PackedLinear) and m.in_features * m.out_features < min_weights:
            return m.unpacked()
        if type(m) is nn.Linear and id(m.weight) not in tied and m.weight.numel() >= min_weights:
            return PackedLinear(m)
        return m

    _replace(model, swap)
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def unpack_linears(model: nn.Module) -> None:
    """The inverse of pack_linears: plain `nn.Linear`s with the loaded weights, bit-exact."""
    _replace(model, lambda m: m.unpacked() if isinstance(m, PackedLinear) else m)


def _replace(model: nn.Module, swap) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = swap(child)
            if new is not child:
                setattr(parent, name, new)
