"""The bench's recompute figure (pdserve/bench/recompute_cost.py): one layer of the layout's model
shape, timed through the engine, scaled to the layout's layers."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.kvstore_bench import _layouts
from pdserve.bench.recompute_cost import layer_config, one_layer, recompute_cost
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kv.layout import KVLayout


def test_the_7b_layouts_layer_is_llama_3_8bs():
    config = layer_config(_layouts(16)["7b"].layout)
    assert (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.num_layers) == (4096, 14336, 32, 8, 128, 1)


def test_the_timed_layer_writes_one_layer_of_the_layouts_kv():
    layout = KVLayout(3, 2, 16, 16, "float32")
    engine = LLMEngine(one_layer(layout, torch.float32), EngineConfig(num_blocks=8))
    assert engine.profile.layout == KVLayout(1, 2, 16, 16, "float32")


def test_one_layers_time_is_scaled_to_the_layouts_layers():
    got = recompute_cost(KVLayout(3, 2, 16, 16, "float32"), tokens=64, repeats=1)
    assert got["prompt_tokens"] == 64 and got["dtype"] in ("bfloat16", "float32")
    assert got["layer_ms"] > 0
    assert got["recompute_us_per_token"] == pytest.approx(got["layer_ms"] * 1e3 / 64 * 3)
