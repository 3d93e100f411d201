"""Engine configuration."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pdserve.engine.device import check_device_name

ATTENTION_BACKENDS = ("auto", "kernel", "flash", "torch")
LINEAR_WEIGHTS = ("auto", "packed", "plain")


class Role(enum.Enum):
    COLOCATED = "colocated"  # prefill and decode in one engine (baseline, short prompts)
    PREFILL = "prefill"  # computes prompts, holds their KV for export, returns the first token
    DECODE = "decode"  # imports prompt KV, then decodes


@dataclass(frozen=True)
class EngineConfig:
    role: Role = Role.COLOCATED
    block_size: int = 16
    num_blocks: int = 4096
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_num_seqs: int = 128  # running sequences at once
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    mock_cost: Any = None  # a mock_runner.CostModel: run the mock engine instead of the model
    # "kernel": the C kernels (built on first use): decode attention reading pages in place, the KV
    # write and, for float32, the small-batch GEMM, RMSNorm and RoPE. "torch": torch throughout,
    # pages gathered for SDPA. "flash": FlashAttention's paged kernels (CUDA, float16/bfloat16,
    # pages of 256 tokens). "auto": the device's own where it fits, torch (said so) where not.
    attention_backend: str = "auto"
    # auto | cpu | cuda[:N]: weights, the paged KV cache and sampling live there (device.py).
    device: str = "cpu"
    # "packed": every linear's weight reordered once into oneDNN's layout (model/packed_linear.py;
    # CPU, float32 or bfloat16), an error where it cannot be. "plain": nn.Linear's row-major weights
    # (and, for float32 decode steps, the C small-batch GEMM). "auto": plain where that GEMM serves
    # (float32 on AVX-512 or AVX2); otherwise, with the "kernel" backend where oneDNN can, linears
    # of at least 2^20 weights packed (a 1024-wide model's in bfloat16, say), others plain.
    linear_weights: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.linear_weights not in LINEAR_WEIGHTS:
            raise ValueError(f"linear_weights must be one of {', '.join(LINEAR_WEIGHTS)}, "
                             f"got {self.linear_weights!r}")
        check_device_name(self.device)
        if self.mock_cost is not None and self.device not in ("cpu", "auto"):
            raise ValueError(f"the mock engine runs on the CPU, got device {self.device!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
