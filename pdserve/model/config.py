"""Model configuration: one frozen dataclass for every Llama-family checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # As the HF config gives it, e.g. {"rope_type": "llama3", "factor": 8.0, ...}.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False  # (Llama's: gate, up and down projections)
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_out_bias(self) -> bool:
        """Whether o_proj has a bias: Llama's `attention_bias` covers q, k, v and o; Qwen2's bias is q, k, v only."""
        return self.attention_bias and self.architecture == "LlamaForCausalLM"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Map a Hugging Face `config.json` onto our fields."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # (the MLP is SwiGLU: silu(gate) * up)
            raise ValueError(f"unsupported hidden_act {act!r} in config.json; pdserve's MLP supports silu only")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_scaling` + `rope_theta`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        max_positions = hf.get("max_position_embeddings", 4096)
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", arch == "MistralForCausalLM") and window < max_positions:
            # Without sliding-window attention we stay exact by never exceeding the window.
            max_positions = window
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias; Llama exposes it as `attention_bias`.
            attention_bias=hf.get("attention_bias", arch == "Qwen2ForCausalLM"),
            mlp_bias=bool(hf.get("mlp_bias")) and arch == "LlamaForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
        )

    def with_eos(self, eos_token_ids: tuple[int, ...]) -> ModelConfig:
        return dataclasses.replace(self, eos_token_ids=eos_token_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
