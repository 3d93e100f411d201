"""A float32 decode step through the C kernels: every layer in one call, and the sampler's pass."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

B = 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 256 for i in range(n)]


@pytest.mark.parametrize("kernels", [True, False])
def test_logits_that_are_not_finite_are_refused_not_sampled(kernels, monkeypatch):
    """The sampler's greedy tokens and logprobs, through the C pass (CPU) and through torch (other
    devices, or no C compiler): the same tokens, logprobs within 1e-5; NaN or inf refused."""
    from pdserve.engine.sampling import sample
    from pdserve.model import cpu_kernels

    if not kernels:
        monkeypatch.setattr(cpu_kernels, "unbuildable", lambda: "no compiler here")
    logits = torch.randn(3, 258)
    drawn = SamplingParams(temperature=1.0, seed=7)  # the middle row is drawn, not greedy
    tokens, logprobs = sample(logits, [GREEDY, drawn, GREEDY], [None, torch.Generator().manual_seed(7), None])
    greedy = logits.max(dim=-1).indices.tolist()
    assert tokens[0] == greedy[0] and tokens[2] == greedy[2]
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(3), torch.tensor(tokens)]
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    # The drawn row's token is the one its seed draws (the same generator, the same draw).
    probs = torch.softmax(logits[1], dim=-1)
    assert tokens[1] == int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7)).item())
    for bad in (float("nan"), float("inf")):
        logits[1, 5] = bad
        with pytest.raises(ValueError, match="not finite"):
            sample(logits, [GREEDY] * 3, [None] * 3)


def test_decode_steps_run_their_layers_in_one_call_with_the_layer_by_layer_bits(tiny, monkeypatch):
    """A step whose every row decodes runs the decoder stack in one C call (cpu_kernels.decode_layers);
    steps with prompt chunks go layer by layer. Same tokens and the same logprobs, bit for bit, as
    every step layer by layer, under continuous batching; packed weights never take the C call."""
    from pdserve.model import cpu_kernels, kernel_backend
    from pdserve.model.torch_backend import TorchOps

    if not cpu_kernels.small_gemm_available():
        pytest.skip("no small-batch GEMM on this CPU: every linear is torch's, every step layer by layer")
    fused_rows: list[int] = []
    real = cpu_kernels.decode_layers

    def counted(weights, shape, residual, *rest):
        fused_rows.append(residual.shape[0])
        return real(weights, shape, residual, *rest)

    monkeypatch.setattr(cpu_kernels, "decode_layers", counted)
    lengths = [1, B - 1, B, B + 1, 3 * B + 5, 300]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7)

    def run(linear_weights: str = "plain") -> list[tuple[list[int], list[float]]]:
        engine = LLMEngine(tiny, EngineConfig(num_blocks=600, max_num_batched_tokens=64, linear_weights=linear_weights))
        results = engine.generate([prompt(n) for n in lengths], [GREEDY, params] * 3)
        assert engine.scheduler.pool.num_used_blocks == 0
        return [(r.token_ids, r.logprobs) for r in results]

    one_call = run()
    assert fused_rows and set(fused_rows) <= set(range(1, len(lengths) + 1)) and len(lengths) in fused_rows
    calls = len(fused_rows)
    monkeypatch.setattr(kernel_backend.CpuKernelOps, "decoder", TorchOps.decoder)
    assert run() == one_call and len(fused_rows) == calls
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "decode_layers", counted)
    packed = run("packed")
    assert len(fused_rows) == calls, "packed weights have no row-major pointers for the C call"
    assert [t for t, _ in packed][::2] == [t for t, _ in one_call][::2]  # greedy rows: the same tokens
    run()  # plain again: the table is back
    assert len(fused_rows) > calls


def test_a_tiny_temperature_draws_the_top_token_not_nan():
    """Any temperature in (0, 100] is valid; at 1e-38 the top logit divided by it overflowed to
    inf, softmax gave NaN, the draw raised and every request in the step failed with it. Below
    float32's smallest subnormal (1e-46, 5e-324) the temperature itself became 0 (0/0: NaN), and a
    top_p as small made every token dropped."""
    from pdserve.engine.sampling import sample

    temps = (1e-38, 1e-45, 1e-46, 5e-324)
    params = [SamplingParams(temperature=t, seed=1) for t in temps]
    params += [SamplingParams(temperature=1.0, top_p=1e-300, seed=1), GREEDY]
    logits = torch.randn(len(params), 258)
    tokens, _ = sample(logits, params, [torch.Generator().manual_seed(1) for _ in params[:-1]] + [None])
    assert tokens == logits.max(dim=-1).indices.tolist()
