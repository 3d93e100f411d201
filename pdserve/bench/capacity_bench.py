"""`pdserve bench capacity`: how big each pool must be.

Prefill pool: the most prompts of `--prompt-tokens` one worker can take at once with every TTFT
under `--ttft-ms`, and the arrival rate one worker sustains (its prefill tokens/s / prompt length).
Decode pool: the most running sequences one worker holds with TPOT under `--tpot-ms`.
From both and a workload (mean prompt/output lengths and a rate, e.g. from a trace), the number of
prefill and decode workers it needs, and so the P:D ratio. One engine per pool, in this process.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

from pdserve.bench.engine_bench import decode_step_ms
from pdserve.bench.report import emit
from pdserve.bench.workloads import MOONCAKE_TRACE, TOKEN_RANGE
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.mock_runner import CostModel
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import load_model


def _engine(args, num_tokens: int) -> LLMEngine:
    mock = CostModel.load(args.mock_cost).scaled(args.mock_scale) if args.engine == "mock" else None
    return LLMEngine(load_model("tiny"), EngineConfig(num_blocks=num_tokens // 16 + 64,
                                                       max_num_batched_tokens=args.chunk_tokens,
                                                       max_num_seqs=1024, enable_prefix_caching=False,
                                                       mock_cost=mock))


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 977) % TOKEN_RANGE for i in range(n)]


def prefill_ttfts(args, concurrency: int) -> list[float]:
    engine = _engine(args, concurrency * (args.prompt_tokens + 16))
    for i in range(concurrency):
        engine.add_request(f"p{i}", _prompt(args.prompt_tokens, i), SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    ttft = []
    while engine.has_work():
        for _ in engine.step():
            ttft.append((time.perf_counter() - t0) * 1e3)
    return ttft


def decode_tpot(args, batch: int) -> float:
    engine = _engine(args, batch * (args.decode_context + args.decode_steps + 32))
    return decode_step_ms(engine, [_prompt(args.decode_context, i) for i in range(batch)], args.decode_steps)


def _sweep(values, measure, ok) -> tuple[int, dict]:
    best, seen = 0, {}
    for v in values:
        m = measure(v)
        seen[v] = m
        if not ok(m):
            break
        best = v
    return best, seen


def workload_means(args) -> tuple[float, float, float]:
    """(mean prompt tokens, mean output tokens, requests/s) of the trace, lengths scaled by k/512."""
    recs = [json.loads(line) for line in open(args.trace or MOONCAKE_TRACE)]
    span_s = (recs[-1]["timestamp"] - recs[0]["timestamp"]) / 1000 or 1.0
    scale = args.block_tokens / 512
    return (statistics.mean(r["input_length"] for r in recs) * scale,
            statistics.mean(r["output_length"] for r in recs), len(recs) / span_s * args.rate_scale)


def workers_needed(rate: float, mean_in: float, mean_out: float, prefill_tok_s: float, batch: int,
                   tpot_ms: float) -> dict[str, float]:
    """Prefill and decode workers a workload needs, and P:D; the decode pool and P:D only where a
    decode batch met the TPOT limit (none did: no decode figure, not an infinite pool and P:D 0)."""
    out = {"prefill_workers_needed": rate * mean_in / prefill_tok_s}
    if batch and math.isfinite(tpot_ms):
        out["decode_workers_needed"] = decode = rate * mean_out * tpot_ms / 1e3 / batch
        if decode > 0:
            out["p_to_d_ratio"] = out["prefill_workers_needed"] / decode
    return out


def run(args: argparse.Namespace) -> None:
    if args.fit_cost_model:
        from dataclasses import asdict

        from pdserve.bench.cost_fit import fit

        cost = fit(load_model("tiny"))
        with open(args.fit_cost_model, "w") as f:
            json.dump(asdict(cost), f, indent=1)
        print(json.dumps(asdict(cost)))
        return
    conc, ttfts = _sweep([1, 2, 4, 8, 16, 32], lambda c: max(prefill_ttfts(args, c)), lambda t: t <= args.ttft_ms)
    tok_s = args.prompt_tokens * 4 / (max(prefill_ttfts(args, 4)) / 1e3)
    batch, tpots = _sweep([1, 2, 4, 8, 16, 32, 64, 128, 256], lambda b: decode_tpot(args, b),
                          lambda t: t <= args.tpot_ms)
    mean_in, mean_out, rate = workload_means(args)
    tpot_at = tpots.get(batch, math.nan)
    pools = workers_needed(rate, mean_in, mean_out, tok_s, batch, tpot_at)
    figures = {
        "engine": args.engine, "prompt_tokens": args.prompt_tokens, "ttft_limit_ms": args.ttft_ms,
        "tpot_limit_ms": args.tpot_ms, "prefill_max_concurrency": conc, "prefill_ttft_by_concurrency_ms": ttfts,
        "prefill_tok_s_per_worker": tok_s, "prefill_max_rate_per_worker": tok_s / args.prompt_tokens,
        "decode_max_batch": batch, "decode_tpot_by_batch_ms": tpots,
        "workload": {"mean_prompt_tokens": mean_in, "mean_output_tokens": mean_out, "rate_rps": rate}, **pools,
    }
    decode_said = "no decode batch within the TPOT limit: no decode pool or P:D"
    if "decode_workers_needed" in pools:
        decode_said = (f"{pools['decode_workers_needed']:.2f} decode workers, "
                       f"P:D = {pools.get('p_to_d_ratio', math.nan):.2f}")
    lines = [f"prefill: {conc} prompts of {args.prompt_tokens} tokens at once within TTFT {args.ttft_ms} ms "
             f"({tok_s:.0f} tok/s per worker -> {tok_s / args.prompt_tokens:.2f} prompts/s)",
             f"decode: {batch} running sequences within TPOT {args.tpot_ms} ms (TPOT {tpot_at:.1f} ms there)",
             f"workload: {rate:.2f} req/s, mean prompt {mean_in:.0f} tok, mean output {mean_out:.0f} tok -> "
             f"{pools['prefill_workers_needed']:.2f} prefill and {decode_said}"]
    emit(figures, [], args.json, lines)


def add_parser(sub) -> None:
    p = sub.add_parser("capacity", help="per-pool capacity under TTFT/TPOT limits, and the P:D ratio a workload needs")
    p.add_argument("--engine", default="real", choices=["real", "mock"])
    p.add_argument("--mock-cost", default="")
    p.add_argument("--mock-scale", type=float, default=1.0)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=30.0)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--trace", default="")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per trace hash_id (lengths scale by k/512)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the trace's request rate by this")
    p.add_argument("--fit-cost-model", default="", metavar="FILE",
                   help="instead: fit the mock cost model to the real engine here and write it to FILE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
