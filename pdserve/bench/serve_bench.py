"""`pdserve bench serve`: open-loop load against a running router, per-request records, summary,
SLO attainment per rate and goodput, written as JSON + Markdown (+ PNG plots with matplotlib)."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

from pdserve.bench import workloads
from pdserve.bench.openai_load import run_openai_load
from pdserve.bench.report import dumps, emit, machine
from pdserve.bench.serve_stats import Record, attainment, gather_progress, goodput, summarize
from pdserve.bench.workloads import BenchRequest
from pdserve.client import AsyncClient, Result, TokenEvent
from pdserve.runtime import gc_tuning
from pdserve.runtime.tasks import cancel_and_wait, measure_loop_lag


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    w = args.workload
    if w == "mooncake":
        reqs = workloads.mooncake(Path(args.trace or workloads.MOONCAKE_TRACE), args.block_tokens, args.max_requests,
                                  args.time_scale, args.max_output)
    elif w == "azure":
        reqs = workloads.azure(Path(args.trace or workloads.AZURE_TRACE), args.max_requests, args.time_scale,
                               args.length_scale, args.max_output)
    elif w == "interference":
        reqs = workloads.interference(long_prompt=args.long_prompt)
    elif w == "shared-prefix":
        groups = 4  # as many requests per group as --max-requests asks for (8 when it is 0)
        reqs = workloads.shared_prefix(groups, -(-args.max_requests // groups) if args.max_requests else 8,
                                       system_tokens=args.prefix_tokens, max_tokens=args.max_output or 16)
    else:
        raise ValueError(f"unknown workload {w!r}")
    if args.max_requests:
        reqs = reqs[: args.max_requests]
    return reqs


async def _one(client: AsyncClient, req: BenchRequest, t_start: float, timeout_s: float) -> Record:
    rec = Record(req.arrival_s, len(req.prompt_ids), req.max_tokens, req.kind)
    delay = t_start + req.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.perf_counter()
    last = None
    try:
        async for item in client.generate_streamed(req.prompt_ids, max_tokens=req.max_tokens, ignore_eos=True,
                                                   timeout_s=timeout_s):
            now = time.perf_counter()
            if isinstance(item, TokenEvent):
                if last is None:
                    rec.ttft_ms = (now - t0) * 1e3
                else:
                    rec.itl_ms.append((now - last) * 1e3)
                last = now
            elif isinstance(item, Result):
                rec.output_tokens = len(item.token_ids)
                rec.cached_local = item.usage["cached_tokens_local"]
                rec.cached_store = item.usage["cached_tokens_store"]
                rec.cached_cluster = item.usage["cached_tokens_cluster"]
                rec.computed = item.usage["computed_tokens"]
                rec.prefill_worker = item.route["prefill"]
                rec.expected_hit_tokens = item.route["expected_hit_tokens"]
                rec.best_hit_tokens = item.route["best_hit_tokens"]
                rec.route_ms = item.timings["route_ms"]
                rec.router_ttft_ms = item.timings.get("ttft_ms", math.nan)
                rec.estimated_ttft_ms = item.route["estimated_ttft_ms"]
        rec.finish(t0)
    except Exception as e:  # noqa: BLE001 - a failed request is a record, not a crash
        rec.fail(t0, e)
    return rec


async def run_load(router: str, reqs: list[BenchRequest], max_seconds: float, timeout_s: float,
                   progress: bool = True, loop_lag_ms: list[float] | None = None) -> tuple[list[Record], float]:
    """`loop_lag_ms`: when given, gets how late this client's own event loop ran (its figures
    include that wait)."""
    gc_tuning.tune()  # the load generator's own full collections paused it 75-595 ms: not the server's time
    lag = asyncio.create_task(measure_loop_lag(loop_lag_ms.append)) if loop_lag_ms is not None else None
    try:
        async with AsyncClient(router, timeout_s=timeout_s) as client:
            t_start = time.perf_counter()
            reqs = [r for r in reqs if r.arrival_s <= max_seconds]
            records = await gather_progress([_one(client, r, t_start, timeout_s) for r in reqs], progress)
            return records, time.perf_counter() - t_start
    finally:
        await cancel_and_wait(lag)


def report_markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = [f"# pdserve bench serve: {doc['workload']}", "", f"Machine: {doc['machine']}", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in doc["settings"].items()), "",
             "| metric | p50 | p90 | p99 |", "|---|---|---|---|"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = s[name]
        lines.append(f"| {name} | {row['p50']:.1f} | {row['p90']:.1f} | {row['p99']:.1f} |")
    lines += ["", f"Requests: {s['ok']} ok / {s['requests']} ({s['errors']} errors) in {s['wall_s']:.1f} s; "
              f"{s['throughput_rps']:.2f} req/s, {s['output_tok_s']:.1f} output tok/s",
              f"Prefix hit ratio (tokens): {s['prefix_hit_ratio_tokens']:.1%} (local {s['hit_tokens_local']}, "
              f"store {s['hit_tokens_store']} of {s['prompt_tokens']})",
              f"SLO TTFT <= {s['slo']['ttft_ms']} ms and TPOT <= {s['slo']['tpot_ms']} ms: attainment "
              f"{s['slo']['attainment']:.1%}"]
    if doc.get("sweep"):
        lines += ["", "| rate (req/s) | attainment |", "|---|---|"]
        lines += [f"| {r} | {a:.1%} |" for r, a in doc["sweep"].items()]
        lines.append(f"\nGoodput (highest rate with >= 90% attainment): {doc['goodput_rps']} req/s")
    return "\n".join(lines) + "\n"


def require_matplotlib() -> None:
    """Fail before the load runs, not after, when the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit("bench serve draws PNG plots with matplotlib: pip install 'pdserve[bench]' "
                         "(or pass --no-plots)") from e


def plots(doc: dict, records: list[Record], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, values in (("ttft_ms", [r.ttft_ms for r in records if r.ok]),
                         ("itl_ms", [x for r in records if r.ok for x in r.itl_ms])):
        if not values:
            continue
        xs = sorted(v for v in values if v > 0)
        if not xs:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set_xscale("log")  # a long tail would squash the body of the CDF on a linear axis
        ax.set_xlabel(f"{name[:-3].upper()} (ms, log scale)")
        ax.set_ylabel("fraction of requests" if name == "ttft_ms" else "fraction of gaps")
        rate = doc["settings"].get("shown_rate")
        ax.set_title(f"{doc['workload']}: CDF of {name[:-3].upper()}"
                     + (f" at {rate:g} req/s (the sweep's last rate)" if rate else ""))
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{name[:-3]}_cdf.png", dpi=100)
        plt.close(fig)
        made.append(f"{name[:-3]}_cdf.png")
    if doc.get("sweep"):
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = sorted(doc["sweep"])
        ax.plot(rates, [doc["sweep"][r] for r in rates], marker="o")
        ax.axhline(0.9, linestyle="--", color="grey")
        ax.set_xlabel("rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_title("SLO attainment vs rate")
        fig.tight_layout()
        fig.savefig(out / "attainment.png", dpi=100)
        plt.close(fig)
        made.append("attainment.png")
    return made


def run(args: argparse.Namespace) -> None:
    if not args.no_plots:
        require_matplotlib()
    base = build_workload(args)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else ([args.rate] if args.rate else [])
    sweep: dict[float, float] = {}
    records: list[Record] = []
    wall = 0.0
    if args.api == "openai" and not args.url:
        raise SystemExit("bench serve --api openai needs --url http://HOST:PORT/v1")
    if args.api == "grpc" and not args.router:
        raise SystemExit("bench serve needs --router HOST:PORT (or --api openai --url URL)")
    for rate in rates or [0.0]:
        reqs = workloads.with_poisson_arrivals(base, rate) if rate else base
        if args.api == "openai":
            load = run_openai_load(args.url, reqs, args.max_seconds, args.timeout_s, not args.json, args.model,
                                   args.api_key)
        else:
            load = run_load(args.router, reqs, args.max_seconds, args.timeout_s, not args.json)
        records, wall = asyncio.run(load)
        if rate:
            sweep[rate] = attainment(records, args.slo_ttft_ms, args.slo_tpot_ms)
    summary = summarize(records, wall, args.slo_ttft_ms, args.slo_tpot_ms)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "json", "api_key")}
    if rates:
        settings["shown_rate"] = rates[-1]  # the records, summary and CDFs are the last rate's
    doc = {"workload": args.workload, "machine": machine(), "summary": summary, "settings": settings,
           "sweep": sweep, "records": [r.to_dict() for r in records]}
    targets = []
    if sweep:
        doc["goodput_rps"] = goodput(sweep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc["plots"] = [] if args.no_plots else plots(doc, records, out)
    (out / "serve.json").write_text(dumps(doc, indent=1))
    (out / "report.md").write_text(report_markdown(doc))
    lines = [report_markdown(doc), f"written: {out / 'serve.json'}, {out / 'report.md'}"
             + "".join(f", {out / p}" for p in doc["plots"])]
    emit({k: v for k, v in doc.items() if k != "records"}, targets, args.json, lines)


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="shared-prefix", choices=["mooncake", "azure", "interference",
                                                                   "shared-prefix"])
    p.add_argument("--trace", default="", help="trace file (default: the one in ../shared/data/traces)")
    p.add_argument("--block-tokens", type=int, default=16, help="mooncake: tokens per hash_id")
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--max-seconds", type=float, default=120.0, help="arrivals after this are left out")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace timestamps by this")
    p.add_argument("--length-scale", type=float, default=0.25, help="azure: multiply prompt lengths by this")
    p.add_argument("--max-output", type=int, default=64, help="cap on output tokens per request (0: none)")
    p.add_argument("--long-prompt", type=int, default=2048, help="interference: long prompt tokens")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="shared-prefix: system prompt tokens")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--timeout-s", type=float, default=300.0)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="open-loop load against a running router (trace replay or Poisson)")
    p.add_argument("--router", default="", help="HOST:PORT of a pdserve router (gRPC)")
    p.add_argument("--api", default="grpc", choices=["grpc", "openai"],
                   help="openai: drive any OpenAI-compatible server at --url (pdserve's HTTP API, vLLM, SGLang...)")
    p.add_argument("--url", default="", help="--api openai: the server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="", help="--api openai: the model name (default: the first /v1/models lists)")
    p.add_argument("--api-key", default="", help="--api openai: bearer key (default: env PDSERVE_API_KEY, then "
                                                 "OPENAI_API_KEY)")
    add_workload_flags(p)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: the trace's own times)")
    p.add_argument("--rates", default="", help="comma-separated rates to sweep for goodput")
    p.add_argument("--out", default="bench-out/serve")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (they need matplotlib)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
