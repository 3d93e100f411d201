"""The attention seam: the model computes through whatever backend and row ops the runner picks,
and both backends give the same tokens."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model import llama
from pdserve.model.kernel_backend import CpuKernelBackend, CpuKernelOps
from pdserve.model.loader import load_model
from pdserve.model.torch_backend import TorchBackend, TorchOps


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 29 + salt * 11 + 5) % 256 for i in range(n)]


def results(loaded, backend: str):
    # 64-token steps: the 300- and 90-token prompts are chunked over cached pages while the others decode.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=200, max_num_batched_tokens=64, attention_backend=backend))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    return engine.generate([prompt(n, n) for n in (1, 15, 16, 17, 90, 300)], params)


def test_torch_and_kernel_backends_give_the_same_greedy_tokens(tiny):
    """float32: the same tokens, logprobs within 1e-4. (In bfloat16 they part: the kernel sums
    scores and values in float32, SDPA rounds to bfloat16; one of these six sequences differs
    from its fourth token on, as it did before the seam.)"""
    by_torch, by_kernel = results(tiny, "torch"), results(tiny, "kernel")
    assert [r.token_ids for r in by_kernel] == [r.token_ids for r in by_torch]
    for a, b in zip(by_kernel, by_torch, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_the_runner_picks_backend_and_row_ops(tiny):
    def picked(backend: str, loaded=tiny):
        runner = LLMEngine(loaded, EngineConfig(num_blocks=8, attention_backend=backend)).runner
        return type(runner.attention_backend), type(runner.row_ops)

    assert picked("torch") == (TorchBackend, TorchOps)
    assert picked("kernel") == picked("auto") == (CpuKernelBackend, CpuKernelOps)
    # The C row ops are float32 only: a bf16 model keeps the C attention and torch's row ops.
    assert picked("kernel", load_model("tiny", torch.bfloat16)) == (CpuKernelBackend, TorchOps)


def test_llama_imports_no_backend():
    """llama.py reaches attention and row ops through the seam only: it imports no kernel module
    (importing it loads none) and names no backend."""
    source = Path(llama.__file__).read_text()
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for a in node.names}
    assert imported == {"__future__", "torch", "torch.nn.functional", "pdserve.model.attention",
                        "pdserve.model.config", "pdserve.model.rope"}
    for word in ("cpu_kernels", "kernel_backend", "torch_backend", "CpuKernel", "TorchBackend", ".name"):
        assert word not in source
    check = ("import sys, pdserve.model.llama; "
             "print(sorted(m for m in sys.modules if m.startswith('pdserve.')))")
    # Run from the checkout holding this llama.py, so that it is the one imported.
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True,
                          cwd=Path(llama.__file__).parents[2])
    assert ast.literal_eval(done.stdout) == ["pdserve.model", "pdserve.model.attention", "pdserve.model.config",
                                             "pdserve.model.llama", "pdserve.model.rope"]
