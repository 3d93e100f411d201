"""`pdserve bench compare`: several configurations on the same workload, one after another in the
same run, side by side: disagg vs colocated on the same cores, and the router policies.

Also computes, in the run itself, the pooled-cache bound for the prefix hit ratio: one LRU cache
as large as every cache that can serve a hit (all workers' caches + the store), same request order.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.deploy import Deployment, DeploySpec
from pdserve.bench.report import Target, dumps, emit, machine
from pdserve.bench.serve_bench import add_workload_flags, build_workload, run_load
from pdserve.bench.serve_stats import attainment, goodput, lru_hit_ratio, percentile, summarize
from pdserve.bench.workloads import TOKEN_RANGE, BenchRequest, with_poisson_arrivals


def pooled_bound(reqs: list[BenchRequest], capacity_blocks: int, block_size: int) -> float:
    """Block hit ratio of one LRU as large as all caches together (chains of full blocks)."""
    chains = []
    for r in reqs:
        ids = r.prompt_ids
        # A full block is named by everything up to its end: the prefix itself stands for its hash.
        chains.append([tuple(ids[: (i + 1) * block_size]) for i in range(len(ids) // block_size)])
    return lru_hit_ratio(chains, capacity_blocks)


def sent_requests(reqs: list[BenchRequest], args) -> list[BenchRequest]:
    """The requests of the pass whose records are reported (the last --rates entry's, or --rate's),
    at its arrival times: those that arrive within --max-seconds, as run_load sends them."""
    rates = [float(r) for r in args.rates.split(",")] if args.rates else []
    rate = rates[-1] if rates else args.rate
    load = with_poisson_arrivals(reqs, rate) if rate else reqs
    return [r for r in load if r.arrival_s <= args.max_seconds]


def fresh(reqs: list[BenchRequest], k: int) -> list[BenchRequest]:
    """The k-th pass of a sweep gets other tokens (same lengths, same sharing among its requests),
    so an earlier pass never warms the caches for a later one."""
    if k == 0:
        return reqs
    return [BenchRequest(r.arrival_s, [(t + 7 * k) % TOKEN_RANGE for t in r.prompt_ids], r.max_tokens, r.kind)
            for r in reqs]


def block_hit_ratio(records, block_size: int, hit=lambda r: r.cached_local + r.cached_store) -> float:
    """Prompt blocks not recomputed / prompt blocks, over the requests that completed. `hit` picks
    which figure counts: the realised reuse, or what the router expected or could have had. NaN
    (not measured) where no completed request had a full block."""
    total = sum(r.prompt_tokens // block_size for r in records if r.ok)
    return sum(hit(r) // block_size for r in records if r.ok) / total if total else math.nan


def hit_breakdown(records, block_size: int) -> dict[str, float]:
    """Where hits were lost, as block hit ratios: `best` (the best-placed worker, per the router's
    index), `expected` (where the policy sent each prompt), `realised` (what the worker reused)."""
    return {"best": block_hit_ratio(records, block_size, lambda r: r.best_hit_tokens),
            "expected": block_hit_ratio(records, block_size, lambda r: r.expected_hit_tokens),
            "realised": block_hit_ratio(records, block_size)}


@dataclass
class Round:
    """One deployment's pass over the workload: what `describe` pools over a configuration's rounds."""
    records: list
    wall_s: float
    client_lag: list[float]
    sweep: dict[float, float]
    router: dict[str, dict]  # the router's own histograms' quantiles, by name
    coefficients: dict[str, float]
    stores: list[dict]  # each node's Stats, its calls counted over every pass (--rates)
    served_all: int  # requests served over every pass (the last pass's are `records`)
    cpus: dict[str, list[int]]


def run_config(spec: DeploySpec, reqs: list[BenchRequest], args) -> Round:
    """One deployment; the workload once (its own times or --rate), or once per --rates entry."""
    rates = [float(r) for r in args.rates.split(",")] if args.rates else []
    sweep: dict[float, float] = {}
    served_all = 0
    dep = Deployment.start(spec)
    try:
        for k, rate in enumerate(rates or [args.rate]):
            load = with_poisson_arrivals(fresh(reqs, k), rate) if rate else reqs
            client_lag: list[float] = []
            with dep.pin_client():
                cpus = {**dep.cpus(), "client": sorted(os.sched_getaffinity(0))}
                records, wall = asyncio.run(run_load(dep.router.address, load, args.max_seconds, args.timeout_s,
                                                     not args.json, client_lag))
            served_all += sum(r.ok for r in records)
            if rate and rates:
                sweep[rate] = attainment(records, args.slo_ttft_ms, args.slo_tpot_ms)
        samples = dep.router_metrics()
        gauges = dep.gauges(samples)
        stores = dep.store_stats()
    finally:
        dep.stop()
    # Where a client-side figure waited: in the router itself, on its loop, or in gRPC's queue
    # before the router's handler took the call (the SDK says its timeout).
    router = {f"router_{name}": dep.histogram_quantiles(samples, name)
              for name in ("refusal_ms", "loop_lag_ms", "before_handler_ms")}
    coefficients = {k.removeprefix("router_ttft_"): v for k, v in gauges.items() if k.startswith("router_ttft_")}
    return Round(records, wall, client_lag, sweep, router, coefficients, stores, served_all, cpus)


def describe(spec: DeploySpec, rounds: list[Round], args) -> dict:
    """A configuration's figures over its rounds' requests together (the router's own histograms:
    its worst round's)."""
    records = [r for rnd in rounds for r in rnd.records]
    summary = summarize(records, sum(rnd.wall_s for rnd in rounds), args.slo_ttft_ms, args.slo_tpot_ms)
    for name in rounds[0].router:
        seen = [rnd.router[name] for rnd in rounds if rnd.router[name]]
        summary[name] = max(seen, key=lambda q: q["p99_at_most"]) if seen else {}
    lag = [x for rnd in rounds for x in rnd.client_lag]
    summary["client_loop_lag_ms"] = {f"p{q}": percentile(lag, q) for q in (50, 99)}
    route_ms = [r.route_ms for r in records if r.ok]
    stores = [st for rnd in rounds for st in rnd.stores]
    sweep = rounds[0].sweep
    return {"mode": spec.mode, "policy": spec.policy, "engine": spec.engine, "prefill": spec.prefill,
            "decode": spec.decode, "rounds": len(rounds), "summary": summary,
            "block_hit_ratio": block_hit_ratio(records, spec.block_size),
            "hit_breakdown": hit_breakdown(records, spec.block_size),
            "route_ms": {f"p{q}": percentile(route_ms, q) for q in (50, 99)},
            "prefill_spread": _spread(records), "sweep": sweep, "goodput_rps": goodput(sweep) if sweep else None,
            "cached_tokens_cluster": sum(r.cached_cluster for r in records if r.ok), "stores": stores,
            "cpus": rounds[0].cpus,
            "store_calls_per_request": _calls_per_request(stores, sum(rnd.served_all for rnd in rounds)),
            "ttft_coefficients": rounds[-1].coefficients}


def _calls_per_request(stores: list[dict], served: int) -> dict[str, float]:
    """The calls every store node took, by method, per request served (the store's load); none
    when nothing was served (they were the totals, as if one request had been)."""
    if not served:
        return {}
    total: dict[str, int] = {}
    for st in stores:
        for method, n in st["calls"].items():
            total[method] = total.get(method, 0) + n
    return {m: round(n / served, 2) for m, n in sorted(total.items(), key=lambda kv: -kv[1])}


def _spread(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.ok and r.prefill_worker:
            out[r.prefill_worker] = out.get(r.prefill_worker, 0) + 1
    return dict(sorted(out.items()))


def markdown(doc: dict) -> str:
    lines = [f"# pdserve bench compare: {doc['workload']}", "", f"Machine: {doc['machine']}", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in doc["settings"].items()), "",
             "| mode | policy | ok | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p99 ms | "
             "block hit ratio: realised (expected / best-placed) | "
             "route p99 ms | SLO attainment |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        s = r["summary"]
        lines.append(f"| {r.get('topology', r['mode'])} | {r['policy']} | {s['ok']}/{s['requests']} | "
                     f"{s['ttft_ms']['p50']:.0f} / "
                     f"{s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p99']:.1f} | "
                     f"{s['itl_ms']['p99']:.1f} | {r['block_hit_ratio']:.1%} ({r['hit_breakdown']['expected']:.1%} / "
                     f"{r['hit_breakdown']['best']:.1%}) | {r['route_ms']['p99']:.2f} | "
                     f"{s['slo']['attainment']:.0%} |")
    for r in doc["runs"]:
        reasons = r["summary"].get("refusals_by_reason") or {}
        if reasons:
            said = "; ".join(f"{k} {v['n']} ({v['p50_ms']:.0f} / {v['p99_ms']:.0f} ms)" for k, v in reasons.items())
            own = r["summary"].get("router_refusal_ms") or {}
            if own:
                said += (f"; in the router itself p50 <= {own['p50_at_most']:g}, p99 <= {own['p99_at_most']:g} ms "
                         f"(mean {own['mean']:.1f})")
            lines.append(f"\n{r.get('topology', r['mode'])} {r['policy']}: refused (p50 / p99): {said}")
        before = r["summary"].get("router_before_handler_ms") or {}
        if before and before["p99_at_most"] >= 50:
            lines.append(f"\n{r.get('topology', r['mode'])} {r['policy']}: waited before the router's handler took "
                         f"the call: p50 <= {before['p50_at_most']:g}, p99 <= {before['p99_at_most']:g} ms (mean "
                         f"{before['mean']:.0f})")
        router_lag, client_lag = r["summary"].get("router_loop_lag_ms") or {}, r["summary"].get("client_loop_lag_ms")
        if router_lag and client_lag:
            lines.append(f"\n{r.get('topology', r['mode'])} {r['policy']}: event-loop lag p99: router <= "
                         f"{router_lag['p99_at_most']:g} ms, bench client {client_lag['p99']:.0f} ms")
    for r in doc["runs"]:
        if r["sweep"]:
            pts = ", ".join(f"{rate:g}/s: {a:.0%}" for rate, a in sorted(r["sweep"].items()))
            lines.append(f"\n{r['mode']} {r['policy']}: SLO attainment {pts}; goodput {r['goodput_rps']:g} req/s")
    for r in doc["runs"]:
        c = r.get("ttft_coefficients") or {}
        fitted = ", ".join(f"{name} {c[name]:.4g}" for name in ("request_ms", "prefill_ms_per_token",
                                                                  "fetch_ms_per_token", "cluster_ms_per_token")
                           if name in c)
        if fitted:
            lines.append(f"\n{r.get('topology', r['mode'])} {r['policy']}: the router's TTFT fit over "
                         f"{c['samples']:.0f} prefills: {fitted}; {r['cached_tokens_cluster']} tokens from the "
                         "cluster tier")
    for r in doc["runs"]:
        calls = r.get("store_calls_per_request") or {}
        if calls:
            lines.append(f"\n{r.get('topology', r['mode'])} {r['policy']}: store calls per request served: "
                         f"{sum(calls.values()):.1f} (" + ", ".join(f"{m} {n:g}" for m, n in calls.items()) + ")")
    if "pooled_bound" in doc:
        lines.append(f"\nPooled-cache bound (one LRU of {doc['pooled_capacity_blocks']} blocks, same order): "
                     f"{doc['pooled_bound']:.1%} of blocks")
    return "\n".join(lines) + "\n"


def _policy_targets(by: dict) -> list[Target]:
    """cache_aware against round_robin in the same run: no errors but refusals, refused fast, and
    TTFT no worse while reusing more of the prefill workers' own caches."""
    ca, rr = by.get(("disagg", "cache_aware")), by.get(("disagg", "round_robin"))
    if ca is None or rr is None:
        return []
    a, b = ca["summary"], rr["summary"]
    out = [Target("cache_aware_errors_other_than_refusals", a["other_errors"], "requests", 0, "<=")]
    if a["refused"]:
        out.append(Target("cache_aware_refusal_p99", a["refusal_ms"]["p99"], "ms", 50.0, "<="))
    for q in ("p50", "p99"):
        if a["ok"] and b["ok"]:
            out.append(Target(f"cache_aware_ttft_{q}_vs_round_robin", a["ttft_ms"][q] / b["ttft_ms"][q], "x", 1.0,
                              "<="))
    if b["hit_tokens_local"]:
        out.append(Target("cache_aware_local_hits_vs_round_robin", a["hit_tokens_local"] / b["hit_tokens_local"],
                          "x", 1.0, ">="))
    return out


def _goodput_target(runs: list[dict]) -> list[Target]:
    """Disaggregated goodput against colocated's, with the disaggregated policy named: the one
    listed first (several were keyed by mode alone, and the last listed stood for all)."""
    swept = [r for r in runs if r["goodput_rps"] is not None and not math.isnan(r["goodput_rps"])]
    disagg = next((r for r in swept if r["mode"] == "disagg"), None)
    colocated = next((r for r in swept if r["mode"] == "colocated"), None)
    if disagg is None or colocated is None or not colocated["goodput_rps"]:
        return []
    return [Target(f"goodput_disagg_{disagg['policy']}_vs_colocated", disagg["goodput_rps"] / colocated["goodput_rps"],
                   "x", 1.5, ">=")]


def _router_target(runs: list[dict]) -> list[Target]:
    """The router's decision p99, the worst disaggregated run's among those that measured it (a run
    that served nothing has none: NaN, which max() kept or dropped by where it stood in the list)."""
    route_p99 = [r["route_ms"]["p99"] for r in runs if r["mode"] == "disagg" and not math.isnan(r["route_ms"]["p99"])]
    return [Target("router_decision_p99", max(route_p99), "ms", 2.0, "<=")] if route_p99 else []


def _spec(args, mode: str, policy: str, **over) -> DeploySpec:
    over = {"store_cache_tokens": args.store_cache_tokens, **over}
    return DeploySpec(mode=mode, policy=policy, engine=args.engine, prefill=args.prefill, decode=args.decode,
                      worker_cache_tokens=args.worker_cache_tokens, decode_kv_tokens=args.decode_kv_tokens,
                      threads=args.threads, pin=args.pin, router_cpus=args.router_cpus,
                      extra_router_flags=(("--colocate-below-tokens", str(args.colocate_below_tokens))
                                          if mode == "disagg" else ()) + (
                          ("--ttft-slo-ms", str(args.router_ttft_slo_ms)) if args.router_ttft_slo_ms else ()) + (
                          ("--stream-interval", str(args.stream_interval)) if args.stream_interval > 1 else ()),
                      extra_worker_flags=("--offload-blocks", str(args.offload_blocks)), **over)


def node_specs(args) -> list[tuple[str, DeploySpec]]:
    """--store-nodes N: the same total capacity twice, cache_aware: N isolated nodes (each node's
    share of the cluster segments as more DRAM of its own) and N nodes sharing the cluster tier."""
    n, seg = args.store_nodes, args.cluster_segment_tokens
    policy = args.policies.split(",")[0]
    return [("isolated", _spec(args, "disagg", policy, store_nodes=n, store_cache_tokens=args.store_cache_tokens
                               + n * seg)),
            ("shared", _spec(args, "disagg", policy, store_nodes=n, cluster_segment_tokens=seg))]


def run(args: argparse.Namespace) -> None:
    if args.rounds < 1 or (args.rounds > 1 and args.rates):
        raise SystemExit("--rounds must be at least 1, and 1 with --rates")
    reqs = build_workload(args)
    if args.store_nodes > 1:
        configs = [({"topology": f"{args.store_nodes} nodes, {topology}"}, spec) for topology, spec in node_specs(args)]
    else:
        configs = [({}, _spec(args, mode, policy)) for mode in args.modes.split(",")
                   for policy in (args.policies.split(",") if mode == "disagg" else ["least_loaded"])]
    # Rounds alternate the order (A B, B A, ...): a host that drifts over the run weighs on each alike.
    rounds: list[list[Round]] = [[] for _ in configs]
    for k in range(args.rounds):
        for i in (range(len(configs)) if k % 2 == 0 else reversed(range(len(configs)))):
            rounds[i].append(run_config(configs[i][1], reqs, args))
    runs = [{**describe(spec, rounds[i], args), **extra} for i, (extra, spec) in enumerate(configs)]
    capacity = (args.prefill * args.worker_cache_tokens + args.store_cache_tokens
                + (args.store_nodes * args.cluster_segment_tokens if args.store_nodes > 1 else 0)) // 16
    doc = {"workload": args.workload, "machine": machine(), "runs": runs,
           "settings": {k: v for k, v in vars(args).items() if k not in ("func", "json")},
           "pooled_capacity_blocks": capacity, "pooled_bound": pooled_bound(sent_requests(reqs, args), capacity, 16)}
    targets = []
    by = {(r["mode"], r["policy"]): r for r in runs}
    if args.store_nodes > 1:
        if doc["pooled_bound"] > 0:
            shared = runs[1]["block_hit_ratio"] / doc["pooled_bound"]
            doc["isolated_vs_pooled_bound"] = runs[0]["block_hit_ratio"] / doc["pooled_bound"]
            targets.append(Target(f"shared_cluster_hit_vs_pooled_bound_{args.store_nodes}_nodes", shared, "x", 0.95,
                                  ">="))
    elif ("disagg", "cache_aware") in by and doc["pooled_bound"] > 0:
        targets.append(Target(f"cache_aware_hit_vs_pooled_bound_{args.prefill}p",
                              by[("disagg", "cache_aware")]["block_hit_ratio"] / doc["pooled_bound"], "x", 0.9, ">="))
    targets += _goodput_target(runs)
    targets += _policy_targets(by)
    targets += _router_target(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(dumps({**doc, "targets": [t.to_dict() for t in targets]}, indent=1,
                                            default=lambda x: None))
    (out / "compare.md").write_text(markdown(doc))
    emit(doc, targets, args.json, [markdown(doc), f"written: {out / 'compare.json'}, {out / 'compare.md'}"])


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="several configurations on one workload, side by side")
    add_workload_flags(p)
    p.add_argument("--engine", default="real", choices=["real", "mock"])
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--modes", default="disagg,colocated")
    p.add_argument("--policies", default="cache_aware,round_robin,least_loaded")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: the workload's times)")
    p.add_argument("--rates", default="", help="comma-separated rates to sweep per configuration (goodput)")
    p.add_argument("--worker-cache-tokens", type=int, default=65536)
    p.add_argument("--decode-kv-tokens", type=int, default=65536, help="disagg: KV pages per decode worker, in tokens")
    p.add_argument("--store-cache-tokens", type=int, default=262144)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--offload-blocks", type=int, default=256,
                   help="prefill workers' staging pages for evicted blocks on their way to the store (0: off)")
    p.add_argument("--colocate-below-tokens", type=int, default=0,
                   help="disagg: prompts with fewer uncached tokens prefill on decode (conditional disaggregation)")
    p.add_argument("--pin", action="store_true",
                   help="workers on CPUs of their own: disagg, P pool and D pool apart; colocated, one CPU each")
    p.add_argument("--router-cpus", default="",
                   help="the router and the load generator on these CPUs of their own (e.g. '0'), the store and "
                        "workers on the rest: the router as a front door on a host of its own")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the router streams tokens N to a message (the first at once)")
    p.add_argument("--router-ttft-slo-ms", type=float, default=0.0,
                   help="the router refuses at once what its TTFT estimate says would take longer (0: never)")
    p.add_argument("--store-nodes", type=int, default=1,
                   help="N > 1: N store nodes, isolated and then sharing a Mooncake cluster tier (same total capacity)")
    p.add_argument("--cluster-segment-tokens", type=int, default=16384,
                   help="--store-nodes: each node's segment of the cluster tier, in tokens it holds (isolated: as "
                        "more DRAM)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each configuration this many times, alternating their order (A B B A ...), and "
                        "report each over all its requests: the host's drift falls on every configuration alike")
    p.add_argument("--out", default="bench-out/compare")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
