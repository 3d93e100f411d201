"""KV layout and hash profile: what makes two workers' KV blocks interchangeable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.config import dtype_name, parse_dtype


@dataclass(frozen=True)
class KVLayout:
    """One block is one contiguous slab [num_layers, 2, num_kv_heads, block_size, head_dim]."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV layout: {name} must be positive, got {getattr(self, name)}")
        parse_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_numel(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def block_nbytes(self) -> int:
        return self.block_numel * self.torch_dtype.itemsize

    def describe(self) -> str:
        return f"L{self.num_layers}x2xH{self.num_kv_heads}xB{self.block_size}xD{self.head_dim}:{self.dtype}"

    @classmethod
    def for_model(cls, config, block_size: int, dtype: torch.dtype) -> KVLayout:
        return cls(config.num_layers, config.num_kv_heads, block_size, config.head_dim, dtype_name(dtype))


@dataclass(frozen=True)
class HashProfile:
    """Everything that makes KV differ for the same tokens; part of every block hash."""

    model_fingerprint: str
    layout: KVLayout

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def key(self) -> str:
        return f"{self.model_fingerprint}|{self.layout.describe()}"

    def mismatch(self, other: HashProfile) -> str | None:
        """Why `other` cannot share KV with us, or None when it can."""
        if self.model_fingerprint != other.model_fingerprint:
            return (f"model fingerprint differs: {other.model_fingerprint[:12]} vs "
                    f"{self.model_fingerprint[:12]}")
        if self.layout != other.layout:
            return f"KV layout differs: {other.layout.describe()} vs {self.layout.describe()}"
        return None
