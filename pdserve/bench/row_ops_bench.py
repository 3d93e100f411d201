"""`pdserve bench row-ops`: do the C small-batch GEMM and pointwise kernels still pay?

One decode step of the whole model (C paged attention in every variant, so only the row ops
differ), timed in one process with the variants interleaved, at the tiny model and at a realistic
shape. The GEMM and the pointwise ops (RMSNorm with the residual add, RoPE) are each run three
ways: eager torch, torch.compile of the same torch ops (inductor, default mode), and the C kernel;
plus torch.compile of the whole model, and each pointwise op alone at decode rows.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdserve.bench.report import emit
from pdserve.kv.layout import KVLayout
from pdserve.model import cpu_kernels
from pdserve.model.attention import AttentionMetadata, RowOps, SeqPages
from pdserve.model.config import ModelConfig
from pdserve.model.kernel_backend import CpuKernelBackend, CpuKernelOps
from pdserve.model.llama import Transformer
from pdserve.model.loader import load_model
from pdserve.model.rope import RotaryEmbedding, rotate
from pdserve.model.torch_backend import TorchOps

BLOCK = 16

REALISTIC = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=12,
    num_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=4096, rope_theta=10000.0)


def _add_rms(h, residual, weight, eps: float):
    residual = h if residual is None else residual + h
    return F.rms_norm(residual, weight.shape, weight, eps), residual


class CompiledOps(TorchOps):
    """TorchOps (float32), each op through torch.compile: one graph per (op, shape)."""

    def __init__(self) -> None:
        torch._dynamo.config.recompile_limit = 256  # never fall back to eager unseen
        self._linear = torch.compile(F.linear, dynamic=False)
        self._rotate = torch.compile(rotate, dynamic=False)
        self._add_rms = torch.compile(_add_rms, dynamic=False)

    def linear(self, mod, x):
        return self._linear(x, mod.weight, mod.bias)

    def rotate(self, qk, cos_sin):
        return self._rotate(qk, cos_sin)

    def add_norm(self, norm, h, residual):
        return self._add_rms(h, residual, norm.weight, norm.eps)


class Mix:
    """The linears of one RowOps, the pointwise ops of another."""

    def __init__(self, gemm: RowOps, pointwise: RowOps):
        self.gemm, self.pointwise = gemm, pointwise

    def linear(self, mod, x):
        return self.gemm.linear(mod, x)

    def rotate(self, qk, cos_sin):
        return self.pointwise.rotate(qk, cos_sin)

    def add_norm(self, norm, h, residual):
        return self.pointwise.add_norm(norm, h, residual)


# (gemm, pointwise); ("model", "model"): torch.compile of the whole model with eager ops, as one
# would compile it instead of writing C.
VARIANTS = [("eager", "eager"), ("compiled", "eager"), ("c", "eager"),
            ("eager", "compiled"), ("eager", "c"), ("c", "c"), ("model", "model")]


def _decode_inputs(config: ModelConfig, batch: int, context: int):
    """A cache holding `batch` sequences of `context - 1` tokens each, and the step adding one to each."""
    pages = -(-context // BLOCK)
    layout = KVLayout(config.num_layers, config.num_kv_heads, BLOCK, config.head_dim, "float32")
    cache = torch.randn(batch * pages + 1, *layout.block_shape) * 0.5
    backend = CpuKernelBackend(layout)
    # Dynamo is not to trace into the ctypes calls: each is a graph break, run as it is.
    backend.write_kv, backend.decode = torch.compiler.disable(backend.write_kv), torch.compiler.disable(backend.decode)
    seqs = [SeqPages(i, 1, context, list(range(i * pages, (i + 1) * pages))) for i in range(batch)]
    pos = torch.full((batch,), context - 1)
    slots = torch.tensor([s.block_ids[(context - 1) // BLOCK] for s in seqs])
    return backend, backend.plan(seqs), torch.arange(batch) % config.vocab_size, pos, slots, cache


def _step_ms(model, inputs, ops: RowOps, steps: int) -> float:
    backend, plan, ids, pos, slots, cache = inputs
    meta = AttentionMetadata(backend, ops, slots, pos % BLOCK, plan)
    with torch.inference_mode():
        model(ids, pos, meta, cache, None)  # warm (and compile); every row's logits
        t0 = time.perf_counter()
        for _ in range(steps):
            model(ids, pos, meta, cache, None)
    return (time.perf_counter() - t0) * 1e3 / steps


def _model_rows(name: str, config: ModelConfig, model, args, lines: list[str]) -> list[dict]:
    ops = {"eager": TorchOps(), "compiled": CompiledOps(), "c": CpuKernelOps()}
    compiled = torch.compile(model, dynamic=False)
    out = []
    for batch in args.batches:
        inputs = _decode_inputs(config, batch, args.context)
        times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for g, p in VARIANTS:
                if g == "model":
                    times[g, p].append(_step_ms(compiled, inputs, ops["eager"], args.steps))
                else:
                    times[g, p].append(_step_ms(model, inputs, Mix(ops[g], ops[p]), args.steps))
        ms = {v: min(t) for v, t in times.items()}  # other work on the machine only ever adds time
        base = ms["eager", "eager"]
        out.append({"model": name, "batch": batch, "context": args.context,
                    **{f"gemm_{g}+pointwise_{p}_ms": round(t, 3) for (g, p), t in ms.items()}})
        lines.append(f"{name} b{batch:<3} step ms (gemm/pointwise): " + "  ".join(
            f"{g}/{p} {t:.2f} ({base / t:.2f}x)" for (g, p), t in ms.items()))
    return out


def _op_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / 50)
    return min(times)


def _pointwise_rows(config: ModelConfig, name: str, batch: int, repeats: int, lines: list[str]) -> list[dict]:
    """Each pointwise op alone on `batch` rows: eager torch, torch.compile, C (µs per call)."""
    d, hd = config.hidden_size, config.head_dim
    h, res, w = torch.randn(batch, d), torch.randn(batch, d), torch.ones(d)
    qk = torch.randn(batch, config.num_heads + config.num_kv_heads, hd)
    # Real angles: rotating in place again and again keeps the values' size.
    cos, sin = RotaryEmbedding(hd, 4096, config.rope_theta, None).at(torch.arange(batch) * 7, torch.float32)
    compiled = CompiledOps()
    ops = {
        "add_rms_norm": (lambda: _add_rms(h, res, w, 1e-5), lambda: compiled._add_rms(h, res, w, 1e-5),
                         lambda: cpu_kernels.add_rms_norm(res, h, w, 1e-5)),
        "rope": (lambda: rotate(qk, (cos, sin)), lambda: compiled._rotate(qk, (cos, sin)),
                 lambda: cpu_kernels.rope_(qk, cos, sin)),
    }
    out = []
    with torch.inference_mode():
        for op, fns in ops.items():
            eager, comp, c = (_op_us(f, repeats) for f in fns)
            out.append({"model": name, "op": op, "rows": batch, "eager_us": round(eager, 2),
                        "compiled_us": round(comp, 2), "c_us": round(c, 2)})
            lines.append(f"{name} {op:<13} {batch:>3} rows: eager {eager:7.2f} us  compiled {comp:7.2f} us  "
                         f"C {c:7.2f} us")
    return out


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = []
    if "tiny" in args.models:
        tiny = load_model("tiny")
        models.append(("tiny", tiny.config, tiny.model))
    if "h1024x12" in args.models:
        models.append(("h1024x12", REALISTIC, Transformer(REALISTIC).eval()))
    figures: dict = {"threads": torch.get_num_threads(), "context": args.context, "steps": args.steps,
                     "small_gemm_built": cpu_kernels.small_gemm_available(),
                     "small_gemm_max_rows": cpu_kernels.SMALL_GEMM_MAX_ROWS, "decode_step": [], "pointwise_op": []}
    lines = [f"row-ops bench: threads={torch.get_num_threads()} context={args.context} small_gemm="
             f"{'built' if figures['small_gemm_built'] else 'not built'} (up to {cpu_kernels.SMALL_GEMM_MAX_ROWS} "
             f"rows) (x: speed-up vs eager/eager)"]
    for name, config, model in models:
        figures["decode_step"] += _model_rows(name, config, model, args, lines)
        for batch in args.batches:
            figures["pointwise_op"] += _pointwise_rows(config, name, batch, args.repeats, lines)
    emit(figures, [], args.json, lines)


def add_parser(sub) -> None:
    p = sub.add_parser("row-ops", help="C small-batch GEMM and pointwise kernels vs eager torch and torch.compile")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 32, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="decode steps per timed sample")
    p.add_argument("--repeats", type=int, default=7, help="interleaved samples per variant (the fastest is kept)")
    p.add_argument("--models", nargs="*", choices=["tiny", "h1024x12"], default=["tiny", "h1024x12"],
                   help="h1024x12: hidden 1024, 12 layers, 16/4 heads of 64, vocab 32000, random weights")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
