"""The C kernels (pdserve/model/csrc) against the torch ops they replace, on exact inputs."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import cpu_kernels
from pdserve.model.rope import RotaryEmbedding, rotate
from pdserve.native import build, cpuinfo_lines

LAYERS, BLOCK = 3, 16


def reference_attention(cache, q, table, ctx, layer):
    """SDPA over the sequence's pages gathered in order: q [heads, D] -> [heads, D] (float32)."""
    pages = -(-ctx // BLOCK)
    kv = cache[table[:pages], layer].float()  # [pages, 2, kv_heads, BLOCK, D]
    k = kv[:, 0].permute(1, 0, 2, 3).reshape(kv.shape[2], -1, kv.shape[-1])[:, :ctx]
    v = kv[:, 1].permute(1, 0, 2, 3).reshape(kv.shape[2], -1, kv.shape[-1])[:, :ctx]
    return F.scaled_dot_product_attention(q.unsqueeze(1), k, v, enable_gqa=True).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(4, 2, 64), (6, 2, 64), (16, 4, 64), (8, 2, 128), (12, 2, 128), (3, 3, 48), (4, 1, 20)])
def test_paged_decode_matches_sdpa_over_gathered_pages(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 7 * BLOCK + 3]
    max_pages = -(-max(lengths) // BLOCK)
    num_blocks = len(lengths) * max_pages + 5
    cache = torch.randn(num_blocks, LAYERS, 2, kv_heads, BLOCK, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lengths) * max_pages].view(len(lengths), max_pages)
    # Rows of q/out are not the sequences' order, and one row (a prefill token) is left alone.
    rows = torch.tensor([5, 0, 3, 1, 2], dtype=torch.long)
    q = torch.randn(6, heads, head_dim, generator=gen)
    out = torch.full((6, heads, head_dim), 7.0)
    layer = 1
    cpu_kernels.paged_decode(cache, q, out, rows, tables.contiguous(), torch.tensor(lengths), layer, head_dim ** -0.5)
    for s, ctx in enumerate(lengths):
        expected = reference_attention(cache, q[rows[s]], tables[s], ctx, layer)
        torch.testing.assert_close(out[rows[s]], expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(out[4], torch.full((heads, head_dim), 7.0))


def test_paged_decode_result_is_independent_of_the_batch():
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(40, LAYERS, 2, 2, BLOCK, 64, generator=gen)
    q = torch.randn(3, 4, 64, generator=gen)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    lens = torch.tensor([40, 33, 17])
    together = torch.empty(3, 4, 64)
    cpu_kernels.paged_decode(cache, q, together, torch.arange(3), tables, lens, 0, 0.125)
    for s in range(3):
        single = torch.empty(1, 4, 64)
        cpu_kernels.paged_decode(cache, q[s:s + 1], single, torch.zeros(1, dtype=torch.long), tables[s:s + 1],
                                 lens[s:s + 1], 0, 0.125)
        assert torch.equal(single[0], together[s])  # bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_indexed_assignment(dtype):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(6, LAYERS, 2, 2, BLOCK, 8, generator=gen).to(dtype)
    expected = cache.clone()
    qkv = torch.randn(5, 4 * 8 + 2 * 8 * 2, generator=gen).to(dtype)  # strided rows, as the model's views
    k = qkv[:, 32:48].view(5, 2, 8)
    v = qkv[:, 48:].view(5, 2, 8)
    blocks = torch.tensor([4, 4, 0, 5, 2])
    offsets = torch.tensor([0, 15, 3, 7, 9])
    cpu_kernels.write_kv(cache, k, v, blocks, offsets, 2)
    expected[blocks, 2, 0, :, offsets] = k
    expected[blocks, 2, 1, :, offsets] = v
    assert torch.equal(cache, expected)


def test_row_ops_match_torch():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 96, generator=gen)
    delta = torch.randn(7, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    residual = x.clone()
    out = cpu_kernels.add_rms_norm(residual, delta, w, 1e-5)
    assert torch.equal(residual, x + delta)  # updated in place
    torch.testing.assert_close(out, F.rms_norm(x + delta, (96,), w, 1e-5), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x.clone(), None, w, 1e-5), F.rms_norm(x, (96,), w, 1e-5),
                               atol=1e-6, rtol=1e-5)

    rope = RotaryEmbedding(64, 4096, 500000.0, {"rope_type": "llama3", "factor": 8.0})
    positions = torch.tensor([0, 1, 17, 4000])
    qkv = torch.randn(4, 8 * 64, generator=gen)
    qk = qkv[:, : 6 * 64].view(4, 6, 64)
    expected = rotate(qk, rope.at(positions, torch.float32))
    untouched = qkv[:, 6 * 64:].clone()
    cpu_kernels.rope_(qk, *rope.at(positions, torch.float32))
    torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, 6 * 64:], untouched)  # v stays as it was

    gate_up = torch.cat([torch.randn(5, 40, generator=gen) * 30, torch.randn(5, 40, generator=gen)], dim=1)
    gate_up[0, :4] = torch.tensor([-1e4, -100.0, 100.0, 1e4])  # exp past float32 on the negative side
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)

    logits = torch.randn(6, 32000, generator=gen) * 8
    logits[1, [10, 20000]] = 100.0  # a tie: the first index, as torch's max gives
    logits[2, -1] = 100.0  # the maximum in the last column
    logits[5] *= 40  # most terms below exp's range (e^-88 and less)
    tokens, top, logz = cpu_kernels.argmax_logz(logits)
    assert tokens == logits.max(dim=-1).indices.tolist() and tokens[1:3] == [10, 31999]
    assert top == logits.max(dim=-1).values.tolist()  # exactly: each row's float32 maximum
    expected = torch.logsumexp(logits.double(), dim=-1)
    torch.testing.assert_close(torch.tensor(logz, dtype=torch.float64), expected, atol=2e-5, rtol=0)
    logits[3, 7], logits[4, 9] = float("nan"), float("inf")
    tokens, top, logz = cpu_kernels.argmax_logz(logits)
    assert [math.isfinite(z) for z in logz] == [True, True, True, False, False, True]
    assert all(0 <= t < 32000 for t in tokens)


def cpu_has(*flags: str) -> bool:
    have = next((line.split(":", 1)[1].split() for line in cpuinfo_lines("flags")), [])
    return all(flag in have for flag in flags)


def _avx2_linear():
    """small_gemm.c built without AVX-512: the 4 x 3 tiles AVX2-only CPUs run, checked here too."""
    lib = build("small_gemm_avx2", [cpu_kernels.SOURCES[2]], [*cpu_kernels.FLAGS, "-mno-avx512f"],
                cpu_kernels.LINK_FLAGS)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.small_gemm_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]

    def linear(x, w, bias=None):
        out = torch.empty(x.shape[0], w.shape[0])
        lib.small_gemm_f32(x.data_ptr(), x.stride(0), w.data_ptr(), None if bias is None else bias.data_ptr(),
                           out.data_ptr(), w.shape[0], x.shape[0], w.shape[0], x.shape[1], 2)
        return out
    return linear


def test_silu_mul_over_threads_gives_each_row_as_alone():
    """A prompt-sized input (over the size that splits rows across threads; odd widths): every
    row's output is the same bits as that row computed alone, on one thread, and close to torch."""
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(301, 2 * 257, generator=gen) * 4
    out = cpu_kernels.silu_mul(gate_up)
    assert out.shape == (301, 257)
    for r in (0, 1, 150, 299, 300):
        assert torch.equal(out[r], cpu_kernels.silu_mul(gate_up[r : r + 1])[0]), r
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not cpu_kernels.small_gemm_available(), reason="no AVX-512 or AVX2 + FMA here")
@pytest.mark.parametrize("build_for", ["this CPU", "AVX2"])
# (13 or more rows against 2 MiB or more of weights take the wide tiles where AVX-512 is: the last two,
# with leftover rows, columns and lanes)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 512, 256), (16, 1408, 256), (5, 258, 704), (3, 7, 19), (64, 33, 100),
                                          (13, 1000, 600), (20, 2051, 257)])
def test_small_gemm_matches_float64_and_each_row_is_independent_of_the_batch(m, n, k, build_for):
    if build_for == "AVX2" and not cpu_has("avx2", "fma"):
        pytest.skip("this CPU has no AVX2 + FMA")
    linear = cpu_kernels.linear if build_for == "this CPU" else _avx2_linear()
    gen = torch.Generator().manual_seed(m * 1000 + n)
    wide = torch.randn(m, k + 5, generator=gen)
    x = wide[:, :k]  # rows strided, as a slice of a wider buffer
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = linear(x, w, bias)
    exact = x.double() @ w.double().t() + bias.double()
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert (out.double() - exact).abs().max().item() < 2e-5 * k ** 0.5
    torch.testing.assert_close(linear(x, w), out - bias, atol=1e-5, rtol=1e-5)
    # A row's result is the same sum whatever rows surround it (full tiles, leftovers, m = 1).
    for i in range(m):
        assert torch.equal(linear(x[i:i + 1].contiguous(), w, bias)[0], out[i])
    assert torch.equal(linear(x[m // 2:], w, bias), out[m // 2:])


def test_kernels_refuse_inputs_they_cannot_read():
    cache = torch.zeros(4, LAYERS, 2, 2, BLOCK, 8)
    q = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.paged_decode(cache, q, torch.empty_like(q), torch.arange(2, dtype=torch.int32),
                                 torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long), 0, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.paged_decode(cache, q.transpose(1, 2).contiguous().transpose(1, 2), torch.empty_like(q),
                                 torch.arange(2), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long),
                                 0, 1.0)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.paged_decode(cache, q.double(), torch.empty_like(q), torch.arange(2),
                                 torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long), 0, 1.0)
    if cpu_kernels.small_gemm_available():
        w = torch.zeros(8, 16)
        with pytest.raises(ValueError, match="not a small float32 GEMM"):
            cpu_kernels.linear(torch.zeros(cpu_kernels.SMALL_GEMM_MAX_ROWS + 1, 16), w)
        with pytest.raises(ValueError, match="not a small float32 GEMM"):
            cpu_kernels.linear(torch.zeros(2, 16), torch.zeros(16, 8).t())  # weight not contiguous
        with pytest.raises(ValueError, match="float32"):
            cpu_kernels.linear(torch.zeros(2, 16, dtype=torch.bfloat16), w)
    if cpu_kernels.small_gemm_available():
        shape = cpu_kernels.DecoderShape(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, eps=1e-5,
                                         scale=1.0)
        one = torch.ones(1, dtype=torch.long)
        cos = torch.ones(1, 1, 8)
        with pytest.raises(ValueError, match="do not fit one float32 decode call"):  # a layer too many
            cpu_kernels.decode_layers(torch.zeros(LAYERS + 1, 7, dtype=torch.long), shape, torch.zeros(1, 32), cos,
                                      cos, cache, one, one, torch.zeros(1, 1, dtype=torch.long), one)
        with pytest.raises(ValueError, match="do not fit one float32 decode call"):  # a row too many
            cpu_kernels.decode_layers(torch.zeros(LAYERS, 7, dtype=torch.long), shape, torch.zeros(2, 32), cos, cos,
                                      cache, one, one, torch.zeros(1, 1, dtype=torch.long), one)
    with pytest.raises(ValueError, match="match the cache"):
        cpu_kernels.write_kv(cache, torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 8), torch.zeros(1),
                             torch.zeros(1), 0)


def test_without_a_compiler_kernel_is_refused_and_auto_says_why(tmp_path):
    """A fresh kernel cache and no compiler on PATH: 'kernel' is a clear error, 'auto' warns and
    decodes through gathered pages, with the same tokens."""
    script = """
import torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model import cpu_kernels
from pdserve.model.loader import load_model
print("WHY", cpu_kernels.available(torch.float32))
tiny = load_model("tiny")
try:
    LLMEngine(tiny, EngineConfig(num_blocks=64, attention_backend="kernel"))
except ValueError as e:
    print("REFUSED", e)
engine = LLMEngine(tiny, EngineConfig(num_blocks=64))
print("BACKEND", engine.runner.attention_backend.name)
print("TOKENS", engine.generate([[5, 6, 7] * 11], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids)
"""
    env = {**os.environ, "PATH": str(tmp_path), "PDSERVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    env.pop("CC", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert lines["WHY"].startswith("no C compiler found")
    assert "attention_backend 'kernel' is unavailable: no C compiler found" in lines["REFUSED"]
    assert lines["BACKEND"] == "torch"
    assert "falls back to gathered pages" in done.stdout + done.stderr
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.model.loader import load_model

    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=64, attention_backend="kernel"))
    expected = engine.generate([[5, 6, 7] * 11], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert lines["TOKENS"] == str(expected)


def test_unknown_attention_backend_is_refused():
    from pdserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="attention_backend must be one of auto, kernel, flash, torch"):
        EngineConfig(attention_backend="cuda")
