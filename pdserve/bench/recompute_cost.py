"""What recomputing a token's KV costs at a KV layout's model shape, measured on this machine.

A whole 7-8B model would take most of a small host's memory (16 GB in bfloat16) and minutes to
build from random weights, and a prefill's time is its layers' (the LM head runs on one row per
prompt): so one decoder layer of the shape (Llama-3-8B's widths for
the 7B-shaped layout: 32 query heads of the layout's head size, its KV heads, MLP 3.5x hidden)
prefills a prompt through pdserve's engine, and the figure is its time per token times the
layout's layer count. bfloat16 where oneDNN runs it (AMX or AVX512-BF16), float32 otherwise.
"""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.layout import KVLayout
from pdserve.model import packed_linear
from pdserve.model.config import ModelConfig, dtype_name
from pdserve.model.llama import Transformer
from pdserve.model.loader import LoadedModel
from pdserve.model.tokenizer import BYTE_VOCAB_SIZE, Tokenizer

QUERY_HEADS = 32  # Llama-2/3 7-8B: hidden = 32 heads x 128
MLP_RATIO = 3.5  # Llama-3-8B: 14,336 / 4,096


def layer_config(layout: KVLayout) -> ModelConfig:
    """One decoder layer of the layout's model shape, with a byte vocabulary."""
    hidden = QUERY_HEADS * layout.head_dim
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE + 2, hidden_size=hidden,
                       intermediate_size=int(hidden * MLP_RATIO), num_layers=1, num_heads=QUERY_HEADS,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                       eos_token_ids=(BYTE_VOCAB_SIZE + 1,), bos_token_id=BYTE_VOCAB_SIZE)


def one_layer(layout: KVLayout, dtype: torch.dtype) -> LoadedModel:
    """layer_config(layout) with random weights (a fixed seed)."""
    config = layer_config(layout)
    model = Transformer(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model = model.to(dtype).eval()
    model.rope.float()
    return LoadedModel(f"one-layer-{layout.describe()}", config, model, Tokenizer.byte_level(), dtype,
                       fingerprint="0" * 64)


def recompute_cost(layout: KVLayout, tokens: int = 512, repeats: int = 3) -> dict:
    """{"recompute_us_per_token", "dtype", "layer_ms", "prompt_tokens"}: the median of `repeats`
    prefills of `tokens` tokens through one layer (after one untimed), scaled to the layout's layers."""
    dtype = torch.bfloat16 if packed_linear.unavailable(torch.device("cpu"), torch.bfloat16) is None \
        else torch.float32
    loaded = one_layer(layout, dtype)
    bs = layout.block_size
    engine = LLMEngine(loaded, EngineConfig(num_blocks=-(-tokens // bs) + 8, block_size=bs,
                                            max_num_batched_tokens=tokens, max_num_seqs=1,
                                            enable_prefix_caching=False))
    prompt = [(i * 131 + 17) % BYTE_VOCAB_SIZE for i in range(tokens)]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1))
        times.append(time.perf_counter() - t0)
    layer_s = statistics.median(times[1:])
    return {"recompute_us_per_token": layer_s / tokens * layout.num_layers * 1e6, "dtype": dtype_name(dtype),
            "layer_ms": layer_s * 1e3, "prompt_tokens": tokens}
