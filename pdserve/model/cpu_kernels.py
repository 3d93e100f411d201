"""The C kernels (csrc/: decode attention, pointwise ops, small-batch GEMM, and a decode step's
decoder layers through them in one call): built on first use, called through ctypes.

Built with the machine's C compiler for this CPU (-O3 -march=native, OpenMP: it shares torch's
libgomp, already loaded under the same soname), once per machine (pdserve/native.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.native import NativeUnavailable, build

SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("paged_decode.c", "pointwise.c", "small_gemm.c", "decode_layers.c")]
# -ffast-math lets expf vectorize (glibc's libmvec). It is given when compiling only: linked with
# it, gcc would add crtfastmath.o, which turns on flush-to-zero for the whole process (torch too).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11", "-ffast-math"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


KernelUnavailable = NativeUnavailable  # the kernels cannot be built or loaded here


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel library (built now if this machine has none yet)."""
    lib = build("cpu_ops", SOURCES, FLAGS, LINK_FLAGS)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for suffix in _SUFFIX.values():
        fn = getattr(lib, f"paged_decode_{suffix}")
        fn.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, *[i64] * 8, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        fn = getattr(lib, f"write_kv_{suffix}")
        fn.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, *[i64] * 6]
        fn.restype = None
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_float]
    lib.rms_norm_f32.restype = None
    lib.rope_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64]
    lib.rope_f32.restype = None
    lib.small_gemm_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.small_gemm_f32.restype = None
    lib.small_gemm_available.restype = ctypes.c_int
    lib.silu_mul_f32.argtypes = [ptr, i64, ptr, i64, i64, i64, ctypes.c_int]
    lib.silu_mul_f32.restype = None
    lib.argmax_logz_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.argmax_logz_f32.restype = None
    lib.decode_layers_f32.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                                      *[i64] * 8, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.decode_layers_f32.restype = ctypes.c_int
    return lib


def unbuildable() -> str | None:
    """None when the kernels build and load here; otherwise why not."""
    try:
        library()
    except (KernelUnavailable, OSError) as e:
        return str(e)
    return None


def available(dtype: torch.dtype) -> str | None:
    """None when the kernel serves this cache dtype here; otherwise why not."""
    return f"no kernel for {dtype}" if dtype not in _SUFFIX else unbuildable()


def _rows_of(t: torch.Tensor, per_row: int) -> int:
    """The row stride of t [T, ...], whose rows must each be `per_row` contiguous elements."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            break
        expected *= size
    if expected != per_row or t.dim() < 2:
        raise ValueError(f"rows of {tuple(t.shape)} (strides {t.stride()}) are not {per_row} contiguous elements")
    return t.stride(0)


@functools.cache
def _fn(name: str):
    return getattr(library(), name)


def _indices(*ts: torch.Tensor) -> None:
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in ts):
        raise ValueError("page ids, offsets, rows and lengths are contiguous int64 tensors")


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
             layer: int) -> None:
    """The new tokens' k, v [T, kv_heads, head_dim] (rows may be strided) into slot offsets[r] of
    page blocks[r] (int64 [T]) of `layer`, as `kv_cache[blocks, layer, 0|1, :, offsets] = k|v`."""
    _, layers, _, kv_heads, block_size, head_dim = kv_cache.shape
    if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype or not kv_cache.is_contiguous():
        raise ValueError(f"write_kv: k {k.dtype} / v {v.dtype} do not match the cache ({kv_cache.dtype})")
    _indices(blocks, offsets)
    _fn(f"write_kv_{_SUFFIX[kv_cache.dtype]}")(
        kv_cache.data_ptr(), k.data_ptr(), _rows_of(k, kv_heads * head_dim), v.data_ptr(),
        _rows_of(v, kv_heads * head_dim), blocks.data_ptr(), offsets.data_ptr(), blocks.numel(), layer, layers,
        kv_heads, block_size, head_dim)


def paged_decode(kv_cache: torch.Tensor, q: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, layer: int, scale: float) -> None:
    """Attention of query rows q[rows[s]] ([heads, head_dim] each) over sequence s's pages, written
    to out[rows[s]]; other rows of out are left alone. q and out float32 [T, heads, head_dim]
    (rows may be strided). kv_cache [num_blocks, layers, 2, kv_heads, block_size, head_dim]
    (contiguous, CPU); block_tables [n, max_pages] int64 (only the first
    ceil(context_len / block_size) are read); context_lens [n] int64, each ≥ 1."""
    _, layers, _, kv_heads, block_size, head_dim = kv_cache.shape
    heads = q.shape[1]
    if q.shape[-1] != head_dim or heads % kv_heads or not kv_cache.is_contiguous():
        raise ValueError(f"paged_decode: cache {tuple(kv_cache.shape)} does not fit queries {tuple(q.shape)}")
    if q.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError("paged_decode: queries and output are float32")
    _indices(rows, block_tables, context_lens)
    rc = _fn(f"paged_decode_{_SUFFIX[kv_cache.dtype]}")(
        kv_cache.data_ptr(), q.data_ptr(), _rows_of(q, heads * head_dim), out.data_ptr(),
        _rows_of(out, heads * head_dim), rows.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        rows.numel(), block_tables.shape[1], layer, layers, heads, kv_heads, block_size, head_dim, scale,
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode: out of memory for attention scores")


def _float_rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1 or t.device.type != "cpu":
        raise ValueError(f"{name}: float32 [rows, dim] with contiguous rows expected, got {t.dtype} {tuple(t.shape)}")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (when given), then RMSNorm(x) * weight as a new [rows, dim] tensor."""
    _float_rows(x, "add_rms_norm")
    if delta is not None:
        _float_rows(delta, "add_rms_norm")
        if delta.shape != x.shape:
            raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    rows, dim = x.shape
    if weight.shape != (dim,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight must be float32 [{dim}]")
    out = torch.empty(rows, dim, dtype=torch.float32)
    _fn("rms_norm_f32")(x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
                           0 if delta is None else delta.stride(0), out.data_ptr(), dim, weight.data_ptr(), rows,
                           dim, eps)
    return out


# Decode steps up to this many rows take the small-batch GEMM; larger ones (prefill) take torch's.
# Over the 100M shape's linears, cold (docs/perf-log.md, S30), it leads oneDNN's packed weights at
# 1-16 rows, is even at 32 and behind at 64, and leads torch's row-major GEMM (MKL) at every count
# up to here. It serves every decode batch up to here so that a row's result never depends on the
# batch around it (torch's GEMM gives row 0 of 2 rows other bits than 1 row alone).
SMALL_GEMM_MAX_ROWS = 64


@functools.cache
def small_gemm_available() -> bool:
    """The small-batch GEMM is built for AVX-512 or AVX2 + FMA CPUs; elsewhere torch serves every linear."""
    return unbuildable() is None and bool(library().small_gemm_available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight[n, k]^T (+ bias), float32, for a decode step's few rows (m ≤
    SMALL_GEMM_MAX_ROWS): streams the weights with prefetch, reads them in place."""
    _float_rows(x, "linear")
    m, k = x.shape
    n = weight.shape[0]
    if not small_gemm_available():
        raise KernelUnavailable("the small-batch GEMM needs AVX-512F or AVX2 with FMA; this CPU has neither")
    if m > SMALL_GEMM_MAX_ROWS or weight.shape != (n, k) or weight.dtype != torch.float32 \
            or not weight.is_contiguous() or (bias is not None and (bias.shape != (n,) or not bias.is_contiguous())):
        raise ValueError(f"linear: {tuple(x.shape)} @ {tuple(weight.shape)}^T is not a small float32 GEMM")
    out = torch.empty(m, n, dtype=torch.float32)
    _fn("small_gemm_f32")(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), n, m, n, k, torch.get_num_threads())
    return out


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate qk [T, heads, head_dim] (rows may be strided) in place; cos, sin [T, 1, head_dim]."""
    tokens, heads, head_dim = qk.shape
    if qk.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("rope_: float32 queries/keys and cos/sin tables expected")
    if cos.shape != (tokens, 1, head_dim) or sin.shape != cos.shape or not cos.is_contiguous() \
            or not sin.is_contiguous():
        raise ValueError(f"rope_: cos/sin must be contiguous [{tokens}, 1, {head_dim}]")
    _fn("rope_f32")(qk.data_ptr(), _rows_of(qk, heads * head_dim), cos.data_ptr(), sin.data_ptr(), tokens, heads,
                       head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of each row [gate | up] of gate_up [rows, 2 * dim], as a new [rows, dim]."""
    _float_rows(gate_up, "silu_mul")
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _fn("silu_mul_f32")(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), width // 2, rows, width // 2,
                        torch.get_num_threads())
    return out


def argmax_logz(logits: torch.Tensor) -> tuple[list[int], list[float], list[float]]:
    """For each row of logits [rows, vocab] (float32): the first index of its maximum, the maximum,
    and log Z, so that token t's logprob is logits[row, t] - log Z (NaN for a row holding NaN or inf).
    Plain lists: a step's sampler needs nothing more of torch after this pass."""
    _float_rows(logits, "argmax_logz")
    rows, vocab = logits.shape
    token = torch.empty(rows, dtype=torch.long)
    top = torch.empty(rows, dtype=torch.float64)
    logz = torch.empty(rows, dtype=torch.float64)
    _fn("argmax_logz_f32")(logits.data_ptr(), logits.stride(0), rows, vocab, token.data_ptr(), top.data_ptr(),
                           logz.data_ptr(), torch.get_num_threads())
    return token.tolist(), top.tolist(), logz.tolist()


# The seven weights of a decoder layer, in decode_layers.c's `layer_weights` order.
LAYER_WEIGHTS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")


@dataclass(frozen=True)
class DecoderShape:
    """What decode_layers needs to know of the model besides its weights."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


def decode_layers(weights: torch.Tensor, shape: DecoderShape, residual: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, kv_cache: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """Every decoder layer of a decode step in one call (csrc/decode_layers.c), each of the m rows
    of residual [m, hidden] (the embedded tokens; the residual stream on return, updated in place)
    one decoding sequence: returns the last layer's MLP output [m, hidden]. weights: int64
    [layers, 7] data pointers in LAYER_WEIGHTS order (0 for a missing bias), float32 contiguous,
    kept alive by the caller; cos, sin [m, 1, head_dim]; the rest as write_kv and paged_decode."""
    m = residual.shape[0]
    _, layers, _, kv_heads, block_size, head_dim = kv_cache.shape
    if residual.dtype != torch.float32 or not residual.is_contiguous() or residual.shape != (m, shape.hidden) \
            or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous() or m > SMALL_GEMM_MAX_ROWS \
            or (kv_heads, head_dim) != (shape.kv_heads, shape.head_dim) or weights.shape != (layers, 7) \
            or cos.shape != (m, 1, head_dim) or sin.shape != cos.shape or not cos.is_contiguous() \
            or not sin.is_contiguous() or block_tables.shape[0] != m or not small_gemm_available():
        raise ValueError("decode_layers: the step, cache or weights do not fit one float32 decode call")
    _indices(weights, slot_blocks, slot_offsets, block_tables, context_lens)
    q_size = shape.heads * head_dim
    qkv = q_size + 2 * kv_heads * head_dim
    out = torch.empty(m, shape.hidden, dtype=torch.float32)
    scratch = torch.empty(m * (shape.hidden + qkv + q_size + 3 * shape.intermediate), dtype=torch.float32)
    rows = torch.arange(m)
    rc = _fn("decode_layers_f32")(
        weights.data_ptr(), layers, residual.data_ptr(), out.data_ptr(), scratch.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), kv_cache.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(), rows.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), block_tables.shape[1], m, shape.hidden, shape.heads,
        kv_heads, head_dim, shape.intermediate, block_size, shape.eps, shape.scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("decode_layers: out of memory for attention scores")
    return out
