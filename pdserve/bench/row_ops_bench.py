"""`pdserve bench row-ops`: do the C small-batch GEMM and pointwise kernels still pay?

One decode step of the whole model (C paged attention in every variant, so only the ops under
test differ), timed in one process with the variants interleaved, at the tiny model and at a
realistic shape. Each op family is run three ways: eager torch, torch.compile of the same torch
ops (inductor, default mode), and the C kernel. Plus each pointwise op alone at decode rows.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdserve.bench.report import emit
from pdserve.model import cpu_kernels, llama
from pdserve.model.config import ModelConfig
from pdserve.model.loader import load_model
from pdserve.model.rope import RotaryEmbedding, rotate

BLOCK = 16

REALISTIC = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=12,
    num_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=4096, rope_theta=10000.0)


def _eager_linear(mod, x, row_ops):
    return mod(x)


def _c_linear(mod, x, row_ops):
    if x.shape[0] <= cpu_kernels.SMALL_GEMM_MAX_ROWS:
        return cpu_kernels.linear(x, mod.weight, mod.bias)
    return mod(x)


COMPILED: dict = {}  # torch.compile of the eager ops, made in run() (importing dynamo is slow)


def _compiled_linear(mod, x, row_ops):
    return COMPILED["linear"](x, mod.weight, mod.bias)


def _add_rms(h, residual, weight, eps: float):
    residual = h if residual is None else residual + h
    return F.rms_norm(residual, weight.shape, weight, eps), residual


def _compile() -> None:
    torch._dynamo.config.recompile_limit = 256  # one graph per (op, shape): never fall back to eager unseen
    # Dynamo is not to trace into the ctypes calls: each is a graph break, run as it is.
    cpu_kernels.paged_decode = torch.compiler.disable(cpu_kernels.paged_decode)
    cpu_kernels.write_kv = torch.compiler.disable(cpu_kernels.write_kv)
    for name, fn in (("linear", F.linear), ("add_rms", _add_rms), ("rotate", rotate)):
        COMPILED[name] = torch.compile(fn, dynamic=False)


def _compiled_add_norm(self, h, residual, row_ops):
    return COMPILED["add_rms"](h, residual, self.weight, self.eps)


LINEARS = {"eager": _eager_linear, "compiled": _compiled_linear, "c": _c_linear}
ORIGINAL = (llama.rotate, llama.RMSNorm.add_norm)


def _use(gemm: str, pointwise: str) -> bool:
    """Point llama at the chosen ops; returns the metadata's row_ops (True: the C pointwise ops)."""
    llama.linear = LINEARS[gemm]
    llama.rotate, llama.RMSNorm.add_norm = ORIGINAL
    if pointwise == "compiled":
        llama.rotate, llama.RMSNorm.add_norm = COMPILED["rotate"], _compiled_add_norm
    return pointwise == "c"


def _decode_inputs(config: ModelConfig, batch: int, context: int):
    """A cache holding `batch` sequences of `context - 1` tokens each, and the step adding one to each."""
    pages = -(-context // BLOCK)
    cache = torch.randn(batch * pages + 1, config.num_layers, 2, config.num_kv_heads, BLOCK, config.head_dim) * 0.5
    tables = torch.arange(batch * pages).view(batch, pages)
    pos = torch.full((batch,), context - 1)
    ids = torch.arange(batch) % config.vocab_size
    paged = llama.PagedDecode(torch.arange(batch), tables, torch.full((batch,), context))
    return ids, pos, cache, tables[:, (context - 1) // BLOCK].contiguous(), paged


def _step_ms(model, inputs, row_ops: bool, steps: int) -> float:
    ids, pos, cache, slot_blocks, paged = inputs
    meta = llama.AttentionMetadata(slot_blocks, pos % BLOCK, (), paged=paged, row_ops=row_ops)
    rows = torch.arange(ids.shape[0])
    with torch.inference_mode():
        model(ids, pos, meta, cache, rows)  # warm (and compile)
        t0 = time.perf_counter()
        for _ in range(steps):
            model(ids, pos, meta, cache, rows)
    return (time.perf_counter() - t0) * 1e3 / steps


# (gemm, pointwise); ("model", "model"): torch.compile of the whole model, eager ops (the C
# attention and KV write break its graphs), as one would compile it instead of writing C.
VARIANTS = [("eager", "eager"), ("compiled", "eager"), ("c", "eager"),
            ("eager", "compiled"), ("eager", "c"), ("c", "c"), ("model", "model")]


def _model_rows(name: str, config: ModelConfig, model, args, lines: list[str]) -> list[dict]:
    out = []
    compiled = torch.compile(model, dynamic=False)
    for batch in args.batches:
        inputs = _decode_inputs(config, batch, args.context)
        times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v in VARIANTS:
                whole = v == ("model", "model")
                row_ops = _use("eager", "eager") if whole else _use(*v)
                times[v].append(_step_ms(compiled if whole else model, inputs, row_ops, args.steps))
        ms = {v: min(t) for v, t in times.items()}  # other work on the machine only ever adds time
        base = ms[("eager", "eager")]
        row = {"model": name, "batch": batch, "context": args.context,
               **{f"gemm_{g}+pointwise_{p}_ms": round(t, 3) for (g, p), t in ms.items()}}
        out.append(row)
        lines.append(f"{name} b{batch:<3} step ms (gemm/pointwise): " + "  ".join(
            f"{g}/{p} {t:.2f} ({base / t:.2f}x)" for (g, p), t in ms.items()))
    _use("eager", "eager")
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
    heads = config.num_heads + config.num_kv_heads
    h, res, w = torch.randn(batch, d), torch.randn(batch, d), torch.ones(d)
    qk = torch.randn(batch, heads, hd)
    # Real angles: rotating in place again and again keeps the values' size.
    cos, sin = RotaryEmbedding(hd, 4096, config.rope_theta, None).at(torch.arange(batch) * 7, torch.float32)
    ops = {
        "add_rms_norm": (lambda: _add_rms(h, res, w, 1e-5), lambda: COMPILED["add_rms"](h, res, w, 1e-5),
                         lambda: cpu_kernels.add_rms_norm(res, h, w, 1e-5)),
        "rope": (lambda: rotate(qk, (cos, sin)), lambda: COMPILED["rotate"](qk, (cos, sin)),
                 lambda: cpu_kernels.rope_(qk, cos, sin)),
    }
    out = []
    with torch.inference_mode():
        for op, fns in ops.items():
            eager, compiled, c = (_op_us(f, repeats) for f in fns)
            out.append({"model": name, "op": op, "rows": batch, "eager_us": round(eager, 2),
                        "compiled_us": round(compiled, 2), "c_us": round(c, 2)})
            lines.append(f"{name} {op:<13} {batch:>3} rows: eager {eager:7.2f} us  compiled {compiled:7.2f} us  "
                         f"C {c:7.2f} us")
    return out


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    _compile()
    models = []
    if "tiny" in args.models:
        tiny = load_model("tiny")
        models.append(("tiny", tiny.config, tiny.model))
    if "h1024x12" in args.models:
        models.append(("h1024x12", REALISTIC, llama.Transformer(REALISTIC).eval()))
    figures: dict = {"threads": torch.get_num_threads(), "context": args.context, "steps": args.steps,
                     "small_gemm_built": cpu_kernels.small_gemm_available(), "decode_step": [], "pointwise_op": []}
    lines = [f"row-ops bench: threads={torch.get_num_threads()} context={args.context} "
             f"small_gemm={'built' if figures['small_gemm_built'] else 'not built'} (x: speed-up vs eager/eager)"]
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
