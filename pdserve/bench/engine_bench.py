"""`pdserve bench engine`: our engine against HF transformers generate(), same model, same process."""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.bench.hf_baseline import to_transformers
from pdserve.bench.report import Target, emit, median
from pdserve.engine.config import EngineConfig
from pdserve.engine.device import describe, resolve_device
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.config import parse_dtype
from pdserve.model.loader import LoadedModel, load_model


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(i * 131 + j * 7919 + 17) % (vocab - 2) for i in range(length)] for j in range(batch)]


def _engine(loaded: LoadedModel, batch: int, length: int, new_tokens: int, device: str) -> LLMEngine:
    slots = length + new_tokens + 16
    return LLMEngine(loaded, EngineConfig(
        num_blocks=batch * (-(-slots // 16)) + 8, max_num_batched_tokens=max(length, 2048),
        max_num_seqs=max(batch, 1), enable_prefix_caching=False, device=device))


def ours_prefill(loaded: LoadedModel, length: int, repeats: int, device: str = "cpu") -> float:
    engine = _engine(loaded, 1, length, 1, device)
    [p] = _prompts(1, length, loaded.config.vocab_size)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.generate([p], SamplingParams(max_tokens=1))
        times.append(time.perf_counter() - t0)
    return length / median(times)


def decode_step_ms(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Admit every prompt, prefill them all, then time `steps` decode steps of the whole batch."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for j, p in enumerate(prompts):
        engine.add_request(f"b{j}", p, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {ev.request_id for ev in engine.step()}
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) * 1e3 / steps


def ours_decode(loaded: LoadedModel, batch: int, context: int, steps: int, device: str = "cpu") -> float:
    engine = _engine(loaded, batch, context, steps + 2, device)
    return batch * 1e3 / decode_step_ms(engine, _prompts(batch, context, loaded.config.vocab_size), steps)


def _hf_generate(hf, ids: torch.Tensor, new_tokens: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False)
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - t0


def hf_prefill(hf, loaded: LoadedModel, length: int, repeats: int) -> float:
    ids = torch.tensor(_prompts(1, length, loaded.config.vocab_size), device=hf.device)
    return length / median([_hf_generate(hf, ids, 1) for _ in range(repeats)])


def hf_decode(hf, loaded: LoadedModel, batch: int, context: int, steps: int) -> float:
    ids = torch.tensor(_prompts(batch, context, loaded.config.vocab_size), device=hf.device)
    return batch * steps / (_hf_generate(hf, ids, steps + 1) - _hf_generate(hf, ids, 1))


def _interleaved(ours, theirs, repeats: int) -> tuple[float, float]:
    """Median of `repeats` alternating runs, so machine noise hits both sides alike."""
    a, b = [], []
    for _ in range(repeats):
        a.append(ours())
        b.append(theirs())
    return median(a), median(b)


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, parse_dtype(args.dtype))
    device = resolve_device(args.device)
    hf = to_transformers(loaded).to(device)
    dev = str(device)
    figures: dict = {"model": args.model, "dtype": args.dtype, "device": describe(device),
                     "threads": torch.get_num_threads(), "decode_steps": args.steps, "prefill": [], "decode": []}
    lines = [f"engine bench: model={args.model} dtype={args.dtype} device={describe(device)} "
             f"threads={torch.get_num_threads()}"]
    for n in args.prefill_lengths:
        ours, theirs = _interleaved(lambda n=n: ours_prefill(loaded, n, 1, dev),
                                    lambda n=n: hf_prefill(hf, loaded, n, 1), args.repeats)
        figures["prefill"].append({"prompt_tokens": n, "pdserve_tok_s": round(ours, 1),
                                   "transformers_tok_s": round(theirs, 1), "ratio": round(ours / theirs, 3)})
        lines.append(f"prefill {n:>5} tok: pdserve {ours:9.0f} tok/s  transformers {theirs:9.0f} tok/s  "
                     f"ratio {ours / theirs:.2f}")
    for ctx in args.contexts:
        for b in args.batches:
            ours, theirs = _interleaved(lambda b=b, c=ctx: ours_decode(loaded, b, c, args.steps, dev),
                                        lambda b=b, c=ctx: hf_decode(hf, loaded, b, c, args.steps), args.repeats)
            figures["decode"].append({"batch": b, "context": ctx, "pdserve_tok_s": round(ours, 1),
                                      "transformers_tok_s": round(theirs, 1), "ratio": round(ours / theirs, 3)})
            lines.append(f"decode batch {b:>3} ctx {ctx:>5}: pdserve {ours:8.0f} tok/s  transformers "
                         f"{theirs:8.0f} tok/s  ratio {ours / theirs:.2f}")
    targets = []
    b16 = [d["ratio"] for d in figures["decode"] if d["batch"] == 16]
    if b16:
        targets.append(Target("decode_batch16_vs_transformers_min", min(b16), "x", 2.0, ">="))
    if figures["prefill"]:
        targets.append(Target("prefill_vs_transformers_min", min(p["ratio"] for p in figures["prefill"]),
                              "x", 0.9, ">="))
    emit(figures, targets, args.json, lines)


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="engine prefill/decode throughput vs transformers generate()")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N (transformers runs there too)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both (0: torch's default)")
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[512, 2048, 4096])
    p.add_argument("--contexts", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
