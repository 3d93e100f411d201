"""Tiny random HF checkpoints for oracle tests (transformers is a test-only dependency)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pdserve.model.tokenizer import Tokenizer

COMMON = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def _make(kind: str):
    if kind == "llama":
        cfg = LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return LlamaForCausalLM(cfg)
    if kind == "llama_100m_2layers":  # the engine bench's 100M shape (pdserve/bench/shapes.py), 2 of its 8 layers
        shape = dict(COMMON, vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                     num_attention_heads=16, num_key_value_heads=4)
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    if kind == "llama_plain":  # no RoPE scaling: what the GGUF conversion covers
        return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False))
    if kind == "llama_linear":
        cfg = LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0})
        return LlamaForCausalLM(cfg)
    if kind == "llama_attention_bias":  # q, k, v and o biases
        return LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True))
    if kind == "llama_mlp_bias":  # gate, up and down biases
        return LlamaForCausalLM(LlamaConfig(**COMMON, mlp_bias=True))
    if kind == "qwen2":
        cfg = Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1000000.0)
        return Qwen2ForCausalLM(cfg)
    if kind == "mistral":
        cfg = MistralConfig(**COMMON, sliding_window=None)
        return MistralForCausalLM(cfg)
    raise ValueError(kind)


def make_checkpoint(kind: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Save a random `kind` model with a byte-level tokenizer under `path`; return the HF model."""
    torch.manual_seed(seed)
    model = _make(kind).eval()
    with torch.no_grad():
        # Wider than HF's default init so logits are peaked and greedy choices are stable.
        model.lm_head.weight.normal_(0.0, 0.5)
        for name, param in model.named_parameters():  # (transformers starts every bias at zero)
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer.byte_level().save(path / "tokenizer.json")
    return model
