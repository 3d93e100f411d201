"""Linears reordered for oneDNN (model/packed_linear.py): the same products as nn.Linear, the
loaded weights given back bit-exact, and the engine's linear_weights choice made real."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model import cpu_kernels, packed_linear
from pdserve.model.loader import fingerprint, load_model
from pdserve.model.packed_linear import PackedLinear, pack_linears, unpack_linears

WHY_NOT = packed_linear.unavailable(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"oneDNN linears unavailable: {WHY_NOT}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
def test_products_equal_nn_linear(rows, bias):
    torch.manual_seed(rows)
    plain = nn.Linear(384, 200, bias=bias)
    packed = PackedLinear(plain)
    x = torch.randn(rows, 384)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
        # A strided view (a split of a wider row) reads the same values.
        wide = torch.randn(rows, 2 * 384)
        torch.testing.assert_close(packed(wide[:, 384:]), plain(wide[:, 384:]), rtol=1e-5, atol=1e-5)


def test_a_packed_linear_refuses_to_change_dtype_or_device():
    packed = PackedLinear(nn.Linear(64, 32))
    with pytest.raises(ValueError, match="stays torch.float32 on the CPU"):
        packed.to(torch.bfloat16)
    with pytest.raises(ValueError, match="on meta"):
        packed.to("meta")


def test_weights_come_back_bit_exact_and_a_tied_head_stays_plain():
    loaded = load_model("tiny")
    model = loaded.model
    linears = sum(type(m) is nn.Linear for m in model.modules())
    tied = model.lm_head.weight is model.embed.weight
    assert pack_linears(model) == linears - tied
    assert pack_linears(model) == linears - tied  # packing twice changes nothing
    assert (type(model.lm_head) is nn.Linear) == tied
    assert fingerprint(loaded.config, model) == loaded.fingerprint  # state_dict gives the loaded bits
    unpack_linears(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert fingerprint(loaded.config, model) == loaded.fingerprint


def test_the_engine_packs_or_unpacks_the_model_it_is_given():
    loaded = load_model("tiny")
    prompts = [[(i * 37 + n) % 250 + 1 for i in range(n)] for n in (9, 16, 33)]
    packed = LLMEngine(loaded, EngineConfig(num_blocks=64, linear_weights="packed"))
    assert packed.runner.linear_weights == "packed"
    assert isinstance(loaded.model.layers[0].attn.wqkv, PackedLinear)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got_packed = [r.token_ids for r in packed.generate(prompts, params)]
    plain = LLMEngine(loaded, EngineConfig(num_blocks=64, linear_weights="plain"))
    assert plain.runner.linear_weights == "plain"
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    assert fingerprint(loaded.config, loaded.model) == loaded.fingerprint
    assert [r.token_ids for r in plain.generate(prompts, params)] == got_packed
    auto = LLMEngine(loaded, EngineConfig(num_blocks=64, attention_backend="torch"))
    assert auto.runner.linear_weights == "plain"  # auto packs with the CPU kernel backend only
    packed_linear.pack_linears(loaded.model)
    auto = LLMEngine(loaded, EngineConfig(num_blocks=64, attention_backend="kernel"))
    assert auto.runner.linear_weights == "plain"  # the tiny model's linears are all below the bar
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())


def test_auto_packs_only_where_the_c_gemm_does_not_serve_decode(monkeypatch):
    """float32 decode steps take the C small-batch GEMM, which reads row-major weights: auto
    leaves them plain there. bfloat16 has no C GEMM: auto packs (oneDNN, AMX where the CPU has it)."""
    monkeypatch.setattr(packed_linear, "AUTO_MIN_WEIGHTS", 0)  # every tiny linear is over the bar
    fp32 = load_model("tiny")
    auto = LLMEngine(fp32, EngineConfig(num_blocks=64, attention_backend="kernel"))
    assert auto.runner.linear_weights == ("plain" if cpu_kernels.small_gemm_available() else "packed")
    if packed_linear.unavailable(torch.device("cpu"), torch.bfloat16) is None:
        bf16 = load_model("tiny", torch.bfloat16)
        auto = LLMEngine(bf16, EngineConfig(num_blocks=64, attention_backend="kernel"))
        assert auto.runner.linear_weights == "packed"
        assert isinstance(bf16.model.layers[0].mlp.w_down, PackedLinear)


def test_auto_packs_only_linears_of_at_least_the_bar():
    big, small = nn.Linear(1024, 1024, bias=False), nn.Linear(256, 512)
    model = nn.Sequential(big, small)
    assert pack_linears(model, packed_linear.AUTO_MIN_WEIGHTS) == 1
    assert isinstance(model[0], PackedLinear) and model[1] is small
    assert pack_linears(model, 2 * packed_linear.AUTO_MIN_WEIGHTS) == 0  # a higher bar unpacks it
    assert type(model[0]) is nn.Linear and torch.equal(model[0].weight, big.weight)


def test_linear_weights_is_checked():
    with pytest.raises(ValueError, match="linear_weights must be one of auto, packed, plain"):
        EngineConfig(linear_weights="fast")
    assert "float16" in packed_linear.unavailable(torch.device("cpu"), torch.float16)
    assert "CPU" in packed_linear.unavailable(torch.device("meta"), torch.float32)
