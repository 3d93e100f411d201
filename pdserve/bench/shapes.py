"""Built-in random checkpoints at realistic shapes, so the engine bench needs no download.

Each is written once as a Hugging Face checkpoint (config.json, model.safetensors, a byte-level
tokenizer) under the cache directory, from a fixed seed: pdserve, transformers and llama.cpp
(after GGUF conversion) then load the very same weights from the very same files.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# The shape issue 24 measures at: about 100M parameters, a small Llama-2/3-like layout.
SHAPES = {
    "llama-100m": dict(vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
                       rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "shapes"


def checkpoint_for(name: str) -> str:
    """`name` itself unless it is a built-in shape; then the path of its checkpoint (written on
    first use)."""
    if name not in SHAPES:
        return name
    path = cache_dir() / name
    if not (path / "model.safetensors").exists():
        _write(name, path)
    return str(path)


def _write(name: str, path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve.model.tokenizer import Tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[name], eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Wider than HF's default init so logits are peaked and greedy choices are stable.
        model.lm_head.weight.normal_(0.0, 0.5)
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    Tokenizer.byte_level().save(tmp / "tokenizer.json")
    tmp.rename(path)
