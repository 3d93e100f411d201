"""`pdserve bench api`: what the OpenAI HTTP API costs over gRPC. One deployment, its router
serving both; the same requests through each, alternating, several rounds; TTFT and ITL as the
client sees them, and the router process's CPU time per streamed token (from /proc).

Targets (issue 21): HTTP adds <= 1 ms to TTFT p50 and <= 0.3 ms to ITL p50, and the router's
CPU per streamed token rises by <= 20%. Judged with a bare-socket HTTP client, so the figures
are the server's; the same run through httpx (the openai SDK's client) is reported beside them."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
from pathlib import Path

from pdserve.bench import workloads
from pdserve.bench.deploy import Deployment, DeploySpec
from pdserve.bench.openai_load import run_openai_load
from pdserve.bench.report import Target, emit
from pdserve.bench.serve_bench import add_workload_flags, build_workload, run_load
from pdserve.bench.serve_stats import percentile

# "http": a bare-socket client, so the figures are the server's; "http_httpx": through httpx, the
# client the openai SDK uses, whose own cost per request is reported, not judged.
APIS = ("grpc", "http", "http_httpx")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_figures(records: list, cpu_s: float) -> dict:
    """One API's figures over its requests (latencies over those served); the router's CPU per
    streamed token only where tokens were streamed and the CPU clock (ticks of 10 ms) saw any."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttft, itl = [r.ttft_ms for r in ok], [x for r in ok for x in r.itl_ms]
    out = {"requests": len(records), "ok": len(ok), "output_tokens": tokens,
           "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
           "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99), "router_cpu_s": cpu_s}
    if tokens and cpu_s > 0:
        out["router_cpu_us_per_token"] = cpu_s / tokens * 1e6
    return out


def http_minus_grpc(g: dict, h: dict) -> tuple[dict, list[Target]]:
    """What HTTP adds over gRPC, and the targets on it (a latency neither side measured is NaN: not
    met); the CPU ratio only where both sides' CPU per token was measured."""
    delta = {k: h[k] - g[k] for k in ("ttft_ms_p50", "itl_ms_p50")}
    if "router_cpu_us_per_token" in g and "router_cpu_us_per_token" in h:
        delta["router_cpu_per_token_ratio"] = h["router_cpu_us_per_token"] / g["router_cpu_us_per_token"]
    names = {"ttft_ms_p50": ("http_added_ttft_p50", "ms", 1.0), "itl_ms_p50": ("http_added_itl_p50", "ms", 0.3),
             "router_cpu_per_token_ratio": ("http_router_cpu_per_token_ratio", "x", 1.2)}
    return delta, [Target(name, delta[k], unit, bar, "<=") for k, (name, unit, bar) in names.items() if k in delta]


def run(args: argparse.Namespace) -> None:
    port_file = Path(tempfile.mkdtemp(prefix="pdserve-api-bench-")) / "http-port"
    spec = DeploySpec(engine=args.engine, extra_router_flags=("--http-port", "0", "--http-port-file", str(port_file),
                                                              "--stream-interval", str(args.stream_interval)))
    d = Deployment.start(spec)
    try:
        url = f"http://127.0.0.1:{int(port_file.read_text())}/v1"
        base = build_workload(args)
        reqs = workloads.with_poisson_arrivals(base, args.rate) if args.rate else base
        pid = d.router.proc.pid
        per = {api: {"records": [], "cpu_s": 0.0} for api in APIS}
        warm = [workloads.BenchRequest(0.0, r.prompt_ids, r.max_tokens) for r in reqs[:4]]
        asyncio.run(run_load(d.router.address, warm, args.max_seconds, args.timeout_s, False))  # (not counted)
        asyncio.run(run_openai_load(url, warm, args.max_seconds, args.timeout_s, False, raw=True))
        for _ in range(args.rounds):
            for api in APIS:
                load = (run_load(d.router.address, reqs, args.max_seconds, args.timeout_s, False) if api == "grpc"
                        else run_openai_load(url, reqs, args.max_seconds, args.timeout_s, False, raw=api == "http"))
                c0 = cpu_s(pid)
                records, _ = asyncio.run(load)
                per[api]["cpu_s"] += cpu_s(pid) - c0
                per[api]["records"] += records
    finally:
        d.stop()
    figures: dict = {api: api_figures(v["records"], v["cpu_s"]) for api, v in per.items()}
    figures["http_minus_grpc"], targets = http_minus_grpc(figures["grpc"], figures["http"])
    figures["settings"] = {k: v for k, v in vars(args).items() if k not in ("func", "json")}
    lines = ["| API | ok | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | router CPU per token (us) |",
             "|---|---|---|---|---|"]
    for api in APIS:
        f = figures[api]
        lines.append(f"| {api} | {f['ok']}/{f['requests']} | {f['ttft_ms_p50']:.2f} / {f['ttft_ms_p99']:.2f} | "
                     f"{f['itl_ms_p50']:.3f} / {f['itl_ms_p99']:.3f} | "
                     f"{f.get('router_cpu_us_per_token', math.nan):.1f} |")
    emit(figures, targets, args.json, lines)


def add_parser(sub) -> None:
    p = sub.add_parser("api", help="the OpenAI HTTP API against gRPC: same stack, same requests, alternating")
    add_workload_flags(p)
    p.set_defaults(max_requests=48, max_output=64)
    p.add_argument("--engine", default="mock", choices=["mock", "real"],
                   help="mock: cost-model step times (steadier figures on a shared machine)")
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running the requests through both APIs")
    p.add_argument("--stream-interval", type=int, default=1, help="the router's: tokens to a message or SSE chunk")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
