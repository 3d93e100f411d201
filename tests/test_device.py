"""The engine's device setting: names resolved or refused at start, everything that matters
placed on the device (cache, weights, step outputs), and the same tokens as the CPU engine.
Runs on `cpu` here and on `cuda` in scripts/gpu_check.sh (PDSERVE_TEST_DEVICE)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.device import resolve_device
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.layout import KVLayout
from pdserve.model import flash_backend
from pdserve.model.loader import load_model
from pdserve.worker.config import WorkerConfig
from tests.support.device import TEST_DEVICE

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    # Around block boundaries (16), and one chunked over cached pages (64-token steps).
    return [[(i * 29 + n * 11 + 5) % 256 for i in range(n)] for n in (1, 15, 16, 17, 33, 150)]


def test_device_names_resolve_or_are_refused_at_start():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu"))
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", ""):
        with pytest.raises(ValueError, match="device must be auto | cpu | cuda | cuda:N"):
            EngineConfig(device=bad)
        with pytest.raises(ValueError, match="device must be"):
            WorkerConfig(device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device here"):
            resolve_device("cuda:1")
    with pytest.raises(ValueError, match="the mock engine runs on the CPU"):
        EngineConfig(device="cuda", mock_cost=object())
    with pytest.raises(ValueError, match="kv_path must be one of auto, direct, staged"):
        WorkerConfig(kv_path="gpu")


def test_cache_weights_and_step_outputs_are_on_the_device():
    device = resolve_device(TEST_DEVICE)
    loaded = load_model("tiny")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, device=TEST_DEVICE))
    assert engine.device == device
    assert engine.kv_cache.tensor.device == device
    placed = {t.device for t in [*loaded.model.parameters(), *loaded.model.buffers()]}
    assert placed == {device}
    seen = []
    hook = loaded.model.register_forward_hook(lambda _m, _args, out: seen.append(out.device))
    try:
        result = engine.generate([prompts()[3]], GREEDY)[0]
    finally:
        hook.remove()
    assert len(result.token_ids) == 12 and seen and set(seen) == {device}
    assert engine.runner.attention_backend.name == ("kernel" if device.type == "cpu" else
                                                    "flash" if flash_backend.unavailable(
                                                        engine.kv_cache.layout, device) is None else "torch")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_tokens_on_the_device_equal_the_cpu_engine(tiny, backend):
    """Under continuous batching with chunked prefill: greedy tokens equal, logprobs close (the
    same kernels here; on CUDA, another summation order)."""
    cpu = LLMEngine(tiny, EngineConfig(num_blocks=200, max_num_batched_tokens=64, device="cpu"))
    want = cpu.generate(prompts(), GREEDY)
    on_device = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=200, max_num_batched_tokens=64,
                                                            device=TEST_DEVICE, attention_backend=backend))
    got = on_device.generate(prompts(), GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4 if TEST_DEVICE == "cpu" else 2e-3)
    assert on_device.scheduler.pool.num_used_blocks == 0


def test_seeded_sampling_draws_the_same_on_every_device(tiny):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
    cpu = LLMEngine(tiny, EngineConfig(num_blocks=64, device="cpu")).generate([prompts()[4]], params)
    dev = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=64, device=TEST_DEVICE)).generate(
        [prompts()[4]], params)
    assert dev[0].token_ids == cpu[0].token_ids


def test_flash_backend_says_which_constraint_does_not_fit():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    fp32 = KVLayout(4, 2, 16, 64, "float32")
    assert flash_backend.unavailable(fp32, cpu) == "FlashAttention runs on CUDA only"
    assert "float16 or bfloat16, the model runs torch.float32" in flash_backend.unavailable(fp32, cuda)
    assert "pages of a multiple of 256 tokens, the block size is 16" in flash_backend.unavailable(
        KVLayout(4, 2, 16, 64, "bfloat16"), cuda)
    assert "head_dim a multiple of 8 up to 256, got 12" in flash_backend.unavailable(
        KVLayout(4, 2, 256, 12, "bfloat16"), cuda)
    with pytest.raises(ValueError, match="attention_backend 'flash' is unavailable: it serves the CUDA only"):
        LLMEngine(load_model("tiny"), EngineConfig(num_blocks=8, device="cpu", attention_backend="flash"))


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="FlashAttention runs on CUDA (scripts/gpu_check.sh)")
def test_flash_backend_equals_the_torch_backend_on_cuda():
    """bfloat16, 256-token pages: FlashAttention's paged kernels against SDPA over gathered pages,
    prompts chunked over cached pages and decodes in one batch."""
    def run(backend: str):
        engine = LLMEngine(load_model("tiny", torch.bfloat16), EngineConfig(
            block_size=256, num_blocks=16, max_num_batched_tokens=64, device=TEST_DEVICE, attention_backend=backend))
        assert engine.runner.attention_backend.name == backend
        return engine.generate(prompts(), SamplingParams(max_tokens=4, ignore_eos=True))

    flash, torch_ = run("flash"), run("torch")
    assert [r.token_ids[0] for r in flash] == [r.token_ids[0] for r in torch_]
    for a, b in zip(flash, torch_, strict=True):
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=0.05)
