"""`pdserve bench handoff`: the KV handoff's cost and what disaggregation buys.

1. TTFT of one request, broken into queue/load, prefill compute, store write (and how much of
   it hid behind compute), and decode's wait for the KV, for several prompt lengths.
2. ITL of N running decodes while long prompts keep arriving: (a) disaggregated, a prefill and a
   decode worker with one core each; (b) one colocated worker with both cores; plus the same
   decodes with no prompts arriving, idle and loaded runs alternating `--rounds` times (each
   mode's gaps pooled). All in the same run, on the same machine.

Disaggregation puts prefill and decode on different machines; on one small machine the bench
stands in for that by pinning (`--pin`, on when there are two CPUs or more): the prefill worker
and the store on the first CPU, the decode worker and this process (the client that times the
tokens) on the second. Unpinned, the client's own wake-ups wait behind the prefill's compute and
the figure measures the client, not the decode worker. The colocated worker and its client are
never pinned: it gets every core.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import time

from pdserve.bench.report import Target, emit
from pdserve.bench.serve_stats import percentile as pct  # (the benches' one percentile)
from pdserve.runtime.launch import RedisServer, ServiceProcess, redis_reachable
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from services.router.dispatch import DecodeAdmitted, Finished, FirstFromPrefill, disaggregated

_salts = itertools.count(1)


def _prompt(n: int) -> list[int]:
    """A prompt no earlier one shares a block with: no figure is flattered by another's cache."""
    rng = random.Random(next(_salts))
    return [rng.randrange(250) for _ in range(n)]


class Procs:
    def __init__(self, redis_url: str, prefix: str):
        self.common = ["--key-prefix", prefix]
        self.env = {"PDSERVE_REDIS_URL": redis_url}  # (by environment: a flag would show its password in `ps`)
        self.procs: list[ServiceProcess] = []

    def start(self, module: str, *flags: str) -> ServiceProcess:
        p = ServiceProcess(module, "--model", "tiny", *self.common, *flags, env=self.env).start()
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


async def _disagg_request(p, d, rid, ids, max_tokens, times: list[float] | None = None) -> dict:
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out: dict = {}
    async for ev in disaggregated(p, d, rid, ids, sp):
        now = time.perf_counter()
        if isinstance(ev, DecodeAdmitted):
            continue
        if isinstance(ev, FirstFromPrefill):
            out["ttft_ms"] = (now - t0) * 1e3
            out["prefill"] = ev.response
        elif isinstance(ev, Finished):
            out["done"], out["handoff"] = ev.done, ev.handoff
        elif times is not None:
            times.append(now)
    return out


async def _colocated_request(d, rid, ids, max_tokens, times: list[float] | None = None) -> None:
    call = d.Generate(decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=ids, sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True),
        mode=decode_pb2.DECODE_MODE_COLOCATED), timeout=600)
    async for ev in call:
        if ev.HasField("token") and times is not None and ev.token.index > 0:
            times.append(time.perf_counter())


def hidden_fraction(write_ms: float, exposed_ms: float) -> float:
    """The share of the store write that hid behind compute; NaN (not measured) with no write."""
    return max(0.0, 1 - exposed_ms / write_ms) if write_ms > 0 else float("nan")


async def ttft_breakdown(prefill_addr: str, decode_addr: str, lengths: list[int], repeats: int) -> list[dict]:
    from pdserve.runtime.server import channel

    rows = []
    async with channel(prefill_addr) as pc, channel(decode_addr) as dc:
        p, d = prefill_pb2_grpc.PrefillStub(pc), decode_pb2_grpc.DecodeStub(dc)
        await _disagg_request(p, d, "warmup", _prompt(64), 2)
        for n in lengths:
            samples = [await _disagg_request(p, d, f"ttft-{n}-{r}", _prompt(n), 4) for r in range(repeats)]
            t = [s["prefill"].timings for s in samples]
            med = statistics.median
            write = med([s["handoff"].store_write_ms for s in samples])
            exposed = med([s["handoff"].store_write_exposed_ms for s in samples])  # after the first token
            rows.append({
                "prompt_tokens": n, "ttft_ms": med([s["ttft_ms"] for s in samples]),
                "queue_and_load_ms": med([x.queue_ms + x.load_ms for x in t]),
                "prefill_compute_ms": med([x.prefill_ms for x in t]),
                "store_write_ms": write, "store_write_exposed_ms": exposed,
                "transfer_hidden_fraction": hidden_fraction(write, exposed),
                "decode_pull_wait_ms": med([s["done"].timings.pull_wait_ms for s in samples]),
            })
    return rows


async def prefix_reuse(prefill_addr: str, decode_addr: str, n: int, repeats: int) -> dict:
    """TTFT of a prompt whose first 90% is in the prefill worker's cache vs the same length cold."""
    from pdserve.runtime.server import channel

    async with channel(prefill_addr) as pc, channel(decode_addr) as dc:
        p, d = prefill_pb2_grpc.PrefillStub(pc), decode_pb2_grpc.DecodeStub(dc)
        cold, warm, cached = [], [], []
        for r in range(repeats):
            base = _prompt(n)
            cold.append((await _disagg_request(p, d, f"cold-{r}", base, 2))["ttft_ms"])
            keep = int(n * 0.9)
            again = await _disagg_request(p, d, f"warm-{r}", base[:keep] + _prompt(n - keep), 2)
            warm.append(again["ttft_ms"])
            u = again["prefill"].usage
            cached.append(u.cached_tokens_local + u.cached_tokens_store)
        med = statistics.median
        return {"prompt_tokens": n, "cold_ttft_ms": med(cold), "cached90_ttft_ms": med(warm),
                "cached_tokens": med(cached), "ratio": med(warm) / med(cold)}


async def itl_under_load(mode: str, prefill_addr: str, decode_addr: str, args) -> dict:
    """ITL of `args.decodes` running decodes, while long prompts arrive (unless mode ends in _idle)."""
    from pdserve.runtime.server import channel

    async with channel(decode_addr) as dc, channel(prefill_addr or decode_addr) as pc:
        d, p = decode_pb2_grpc.DecodeStub(dc), prefill_pb2_grpc.PrefillStub(pc)
        colocated = mode.startswith("colocated")
        gaps: list[float] = []
        stop = asyncio.Event()

        async def one_decode(i: int) -> None:
            times: list[float] = []
            ids = _prompt(64)
            if colocated:
                await _colocated_request(d, f"{mode}-dec-{i}", ids, args.decode_tokens, times)
            else:
                await _disagg_request(p, d, f"{mode}-dec-{i}", ids, args.decode_tokens, times)
            gaps.extend((b - a) * 1e3 for a, b in zip(times[5:], times[6:], strict=False))

        in_flight: list[asyncio.Future] = []

        async def prompts() -> int:
            sent = 0
            while not stop.is_set():
                ids = _prompt(args.interfere_tokens)
                rid = f"{mode}-long-{sent}"
                if colocated:
                    task = _colocated_request(d, rid, ids, 2)
                else:
                    task = _disagg_request(p, d, rid, ids, 2)
                in_flight.append(asyncio.ensure_future(task))
                sent += 1
                try:
                    await asyncio.wait_for(stop.wait(), args.interfere_every_s)
                except TimeoutError:
                    pass
            return sent

        if not mode.endswith("_idle"):
            # Warm-up, not timed: the first long prompts pay one-time costs (buffers sized for a
            # long context, the first transfer-engine connection) that steady state never sees.
            for i in range(args.warmup):
                ids = _prompt(args.interfere_tokens)
                if colocated:
                    await _colocated_request(d, f"{mode}-warm-{i}", ids, 2)
                else:
                    await _disagg_request(p, d, f"{mode}-warm-{i}", ids, 2)
        interferer = None if mode.endswith("_idle") else asyncio.ensure_future(prompts())
        await asyncio.gather(*(one_decode(i) for i in range(args.decodes)))
        stop.set()
        sent = await interferer if interferer else 0
        await asyncio.gather(*in_flight)  # every long prompt finishes before the channels close
        return {"mode": mode, "gaps": gaps, "long_prompts_sent": sent}


def itl_rounds(modes: list[str], prefill_addr: str, decode_addr: str, args) -> list[dict]:
    """Run the modes in turn, `args.rounds` times, and pool each mode's gaps: a shared machine's
    speed drifts over a run, and alternating exposes every mode to the same drift."""
    gaps: dict[str, list[float]] = {m: [] for m in modes}
    rounds_p99: dict[str, list[float]] = {m: [] for m in modes}
    sent = dict.fromkeys(modes, 0)
    for _ in range(args.rounds):
        for m in modes:
            r = asyncio.run(itl_under_load(m, prefill_addr, decode_addr, args))
            gaps[m] += r["gaps"]
            rounds_p99[m].append(round(pct(r["gaps"], 99), 2))
            sent[m] += r["long_prompts_sent"]
    return [{"mode": m, "itl_p50_ms": pct(gaps[m], 50), "itl_p99_ms": pct(gaps[m], 99), "itl_samples": len(gaps[m]),
             "long_prompts_sent": sent[m], "rounds_p99_ms": rounds_p99[m]} for m in modes]


def run(args: argparse.Namespace) -> None:
    from pdserve import logs

    logs.configure("bench", level="WARNING")
    own_redis = None
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if not redis_reachable(redis_url):
        own_redis = RedisServer().start()
        redis_url = own_redis.url
    procs = Procs(redis_url, f"pdbench-handoff-{os.getpid()}")
    everywhere = os.sched_getaffinity(0)
    cpus = sorted(everywhere)
    pinned = args.pin and len(cpus) >= 2
    p_cpu, d_cpu = ((["--cpus", str(cpus[0])], ["--cpus", str(cpus[1])]) if pinned else ([], []))
    try:
        store = procs.start("services.kvstore", "--device-bytes", str(1 << 30), "--dram-bytes", str(1 << 30), *p_cpu)
        worker = ["--store", store.address, "--num-blocks", str(args.num_blocks)]
        pre = procs.start("services.prefill", *worker, "--threads", "1", *p_cpu)
        dec = procs.start("services.decode", *worker, "--threads", "1", *d_cpu)
        if pinned:
            os.sched_setaffinity(0, {cpus[1]})
        ttft = asyncio.run(ttft_breakdown(pre.address, dec.address, args.lengths, args.repeats))
        reuse = asyncio.run(prefix_reuse(pre.address, dec.address, args.reuse_tokens, args.repeats))
        itl = itl_rounds(["disagg_idle", "disagg"], pre.address, dec.address, args)
        os.sched_setaffinity(0, everywhere)
        colo = procs.start("services.decode", *worker, "--threads", "2")
        itl += itl_rounds(["colocated_idle", "colocated"], "", colo.address, args)
    finally:
        os.sched_setaffinity(0, everywhere)
        procs.stop()
        if own_redis:
            own_redis.stop()
    by = {r["mode"]: r for r in itl}
    figures = {"ttft": ttft, "prefix_reuse": reuse, "itl": itl, "decodes": args.decodes,
               "decode_tokens": args.decode_tokens, "interfere_tokens": args.interfere_tokens,
               "interfere_every_s": args.interfere_every_s, "warmup_prompts": args.warmup, "rounds": args.rounds,
               "pinned": {"prefill_and_store_cpu": cpus[0], "decode_and_client_cpu": cpus[1]} if pinned else None}
    targets = [Target("disagg_itl_p99_vs_idle", by["disagg"]["itl_p99_ms"] / by["disagg_idle"]["itl_p99_ms"], "x",
                      1.3, "<="),
               Target("ttft_90pct_cached_vs_cold", reuse["ratio"], "x", 0.25, "<=")]
    lines = [f"TTFT {r['prompt_tokens']:>5} tok: {r['ttft_ms']:7.1f} ms (load {r['queue_and_load_ms']:.1f} + "
             f"prefill {r['prefill_compute_ms']:.1f}); the handoff completes {r['store_write_exposed_ms']:.1f} ms "
             f"after the first token; store write total {r['store_write_ms']:.1f} ms "
             f"({r['transfer_hidden_fraction']:.0%} hidden behind compute); decode pull wait "
             f"{r['decode_pull_wait_ms']:.1f} ms" for r in ttft]
    lines.append(f"prefix reuse {reuse['prompt_tokens']} tok: cold TTFT {reuse['cold_ttft_ms']:.1f} ms, 90% cached "
                 f"{reuse['cached90_ttft_ms']:.1f} ms ({reuse['cached_tokens']:.0f} tokens reused), "
                 f"ratio {reuse['ratio']:.3f}")
    lines += [f"ITL {r['mode']:<15} p50 {r['itl_p50_ms']:6.2f} ms  p99 {r['itl_p99_ms']:7.2f} ms  "
              f"({r['itl_samples']} gaps, {r['long_prompts_sent']} long prompts; p99 by round "
              f"{', '.join(f'{x:.1f}' for x in r['rounds_p99_ms'])})" for r in itl]
    emit(figures, targets, args.json, lines)


def add_parser(sub) -> None:
    p = sub.add_parser("handoff", help="TTFT breakdown of the KV handoff; ITL disaggregated vs colocated")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reuse-tokens", type=int, default=4096, help="prompt length of the prefix-reuse figure")
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=300)
    p.add_argument("--interfere-tokens", type=int, default=2048)
    p.add_argument("--interfere-every-s", type=float, default=0.5)
    p.add_argument("--warmup", type=int, default=2, help="long prompts sent (untimed) before each loaded ITL run")
    p.add_argument("--rounds", type=int, default=3,
                   help="ITL: idle and loaded runs alternate this many times; each mode's gaps are pooled")
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="disaggregated runs: prefill + store on one CPU, decode + this client on another")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
