"""The built-in `tiny` model: Llama-shaped, weights from a fixed seed, byte-level vocabulary.

Every process builds bit-identical weights, so its fingerprint is the same everywhere.
"""

from __future__ import annotations

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.llama import Transformer
from pdserve.model.tokenizer import BYTE_VOCAB_SIZE, Tokenizer

TINY_SEED = 20261129

TINY_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=BYTE_VOCAB_SIZE + 2,  # bytes, <s>, </s>
    hidden_size=256,
    intermediate_size=704,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    eos_token_ids=(BYTE_VOCAB_SIZE + 1,),
    bos_token_id=BYTE_VOCAB_SIZE,
)


def build_tiny() -> tuple[ModelConfig, Transformer, Tokenizer]:
    tokenizer = Tokenizer.byte_level()
    assert tokenizer.vocab_size == TINY_CONFIG.vocab_size
    model = Transformer(TINY_CONFIG)
    gen = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "embed.weight":
                param.normal_(0.0, 1.0, generator=gen)
            elif name == "lm_head.weight":
                # Peaked logits (std ~3): greedy choices are far from ties.
                param.normal_(0.0, 0.2, generator=gen)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return TINY_CONFIG, model, tokenizer
