"""`pdserve bench engine`: our engine against HF transformers generate() and llama.cpp (the `peer`
extra), the same weights in the same process, alternating."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from pdserve.bench.engine_peer import start_peers
from pdserve.bench.engine_profile import lines_of, profile_steps
from pdserve.bench.hf_baseline import to_transformers
from pdserve.bench.report import Target, emit, median
from pdserve.bench.shapes import checkpoint_for
from pdserve.engine.config import EngineConfig
from pdserve.engine.device import describe, resolve_device
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.config import parse_dtype
from pdserve.model.loader import LoadedModel, load_model


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(i * 131 + j * 7919 + 17) % (vocab - 2) for i in range(length)] for j in range(batch)]


def _engine(loaded: LoadedModel, batch: int, length: int, new_tokens: int, device: str,
            linear_weights: str = "auto") -> LLMEngine:
    slots = length + new_tokens + 16
    return LLMEngine(loaded, EngineConfig(
        num_blocks=batch * (-(-slots // 16)) + 8, max_num_batched_tokens=max(length, 2048),
        max_num_seqs=max(batch, 1), enable_prefix_caching=False, device=device, linear_weights=linear_weights))


def ours_prefill(loaded: LoadedModel, length: int, repeats: int, device: str = "cpu",
                 linear_weights: str = "auto") -> float:
    engine = _engine(loaded, 1, length, 1, device, linear_weights)
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


def ours_decode(loaded: LoadedModel, batch: int, context: int, steps: int, device: str = "cpu",
                linear_weights: str = "auto") -> float:
    engine = _engine(loaded, batch, context, steps + 2, device, linear_weights)
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
    """Decode tok/s: `steps` more tokens' time, as the difference of two generate() calls; NaN
    (not measured) where that difference is not positive: noise larger than the steps' time."""
    ids = torch.tensor(_prompts(batch, context, loaded.config.vocab_size), device=hf.device)
    decode_s = _hf_generate(hf, ids, steps + 1) - _hf_generate(hf, ids, 1)
    return batch * steps / decode_s if decode_s > 0 else math.nan


def _interleaved(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each side's figures over `repeats` alternating rounds, so machine noise hits all alike."""
    got: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, measure in sides.items():
            got[name].append(measure())
    return got


def _row(got: dict[str, list[float]]) -> dict:
    """pdserve's median and min, each baseline's median, llama.cpp's best setting, the ratios (not
    rounded: a target is judged on the figure, not on its display)."""
    ours = got.pop("pdserve")
    row = {"pdserve_tok_s": round(median(ours), 1), "pdserve_min_tok_s": round(min(ours), 1)}
    theirs = got.pop("transformers", [])
    if theirs and all(t > 0 for t in theirs):  # (a repeat it could not time, NaN: the figure is absent)
        row |= {"transformers_tok_s": round(median(theirs), 1), "ratio": median(ours) / median(theirs)}
    if got:  # llama.cpp, one entry per setting: the best one's median is the bar
        best = max(got, key=lambda k: median(got[k]))
        row |= {"llama_cpp": {k: {"median_tok_s": round(median(v), 1), "min_tok_s": round(min(v), 1)}
                              for k, v in got.items()},
                "llama_cpp_best": best, "vs_llama_cpp": median(ours) / median(got[best])}
    return row


def _say(what: str, row: dict) -> str:
    parts = [f"{what}: pdserve {row['pdserve_tok_s']:9.0f} tok/s"]
    if "transformers_tok_s" in row:
        parts.append(f"transformers {row['transformers_tok_s']:8.0f} (x{row['ratio']:.2f})")
    if "vs_llama_cpp" in row:
        parts.append(f"llama.cpp {row['llama_cpp'][row['llama_cpp_best']]['median_tok_s']:8.0f} "
                     f"[{row['llama_cpp_best']}] (x{row['vs_llama_cpp']:.2f})")
    return "  ".join(parts)


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    path = checkpoint_for(args.model)
    loaded = load_model(path, parse_dtype(args.dtype))
    device = resolve_device(args.device)
    hf = None if args.skip_transformers else to_transformers(loaded).to(device)
    dev, lw = str(device), args.linear_weights
    threads = torch.get_num_threads()
    chosen = _engine(loaded, 1, 16, 1, dev, lw).runner.linear_weights
    figures: dict = {"model": args.model, "dtype": args.dtype, "device": describe(device), "threads": threads,
                     "linear_weights": chosen, "decode_steps": args.steps, "repeats": args.repeats,
                     "prefill": [], "decode": []}
    lines = [f"engine bench: model={args.model} dtype={args.dtype} device={describe(device)} threads={threads} "
             f"linear weights={chosen}"]
    peers, figures["llama_cpp"] = start_peers(path, args, threads, loaded)
    lines.append(f"llama.cpp: {figures['llama_cpp']}")
    try:
        for n in args.prefill_lengths:
            [p] = _prompts(1, n, loaded.config.vocab_size)
            sides = {"pdserve": lambda n=n: ours_prefill(loaded, n, 1, dev, lw)}
            if hf is not None:
                sides["transformers"] = lambda n=n: hf_prefill(hf, loaded, n, 1)
            sides |= {label: (lambda peer=peer, p=p: peer.prefill_tok_s(p)) for label, peer in peers.items()}
            row = {"prompt_tokens": n, **_row(_interleaved(sides, args.repeats))}
            figures["prefill"].append(row)
            lines.append(_say(f"prefill {n:>5} tok", row))
        for ctx in args.contexts:
            for b in args.batches:
                ps = _prompts(b, ctx, loaded.config.vocab_size)
                sides = {"pdserve": lambda b=b, c=ctx: ours_decode(loaded, b, c, args.steps, dev, lw)}
                if hf is not None:
                    sides["transformers"] = lambda b=b, c=ctx: hf_decode(hf, loaded, b, c, args.steps)
                sides |= {label: (lambda peer=peer, ps=ps: peer.decode_tok_s(ps, args.steps))
                          for label, peer in peers.items()}
                row = {"batch": b, "context": ctx, **_row(_interleaved(sides, args.repeats))}
                figures["decode"].append(row)
                lines.append(_say(f"decode batch {b:>3} ctx {ctx:>5}", row))
    finally:
        for peer in peers.values():
            peer.close()
    if args.profile:
        figures["profile"] = profile_steps(loaded, max(args.prefill_lengths, default=512),
                                           max(args.batches, default=16), min(args.contexts, default=512), dev)
        lines += lines_of(figures["profile"])
    emit(figures, targets_of(figures), args.json, lines)


def targets_of(figures: dict) -> list[Target]:
    targets = []
    b16 = [d["ratio"] for d in figures["decode"] if d["batch"] == 16 and "ratio" in d]
    if b16:
        targets.append(Target("decode_batch16_vs_transformers_min", min(b16), "x", 2.0, ">="))
    pre = [p["ratio"] for p in figures["prefill"] if "ratio" in p]
    if pre:
        targets.append(Target("prefill_vs_transformers_min", min(pre), "x", 0.9, ">="))
    for p in figures["prefill"]:
        if "vs_llama_cpp" in p:
            targets.append(Target(f"prefill_{p['prompt_tokens']}_vs_llama_cpp", p["vs_llama_cpp"], "x", 1.0, ">="))
    for d in figures["decode"]:
        if "vs_llama_cpp" in d and d["batch"] in (1, 16):
            targets.append(Target(f"decode_batch{d['batch']}_ctx{d['context']}_vs_llama_cpp", d["vs_llama_cpp"],
                                  "x", 1.0 if d["batch"] == 1 else 1.5, ">="))
    return targets


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="engine prefill/decode throughput vs transformers generate()")
    p.add_argument("--model", default="tiny", help="tiny, a built-in random shape (llama-100m) or an HF checkpoint")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N (transformers runs there too)")
    p.add_argument("--linear-weights", default="auto", choices=["auto", "packed", "plain"],
                   help="pdserve's linears: reordered for oneDNN, row-major, or the engine's choice")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both (0: torch's default)")
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[512, 2048, 4096])
    p.add_argument("--contexts", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-transformers", action="store_true", help="no transformers column (slow at real shapes)")
    p.add_argument("--peer", default="auto", choices=["auto", "off"],
                   help="llama.cpp column: auto (when the peer extra is installed and the model converts), off")
    p.add_argument("--peer-settings", nargs="*", default=["f32", "f16+fa"],
                   help="llama.cpp settings timed (the best is the bar): KV type f32|f16, +fa for flash attention")
    p.add_argument("--profile", action="store_true", help="then profile a prefill and batched decode steps: the ops "
                                                           "ranked by their own time")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
