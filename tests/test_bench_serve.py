"""The serving benchmark's own logic, and a short real run against a stack started here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid

import pytest

from pdserve.bench import workloads
from pdserve.bench.serve_stats import Record, attainment, goodput, lru_hit_ratio, percentile, summarize
from pdserve.kv.hashing import block_hashes
from services.router.policy import over_slo
from tests.support.procs import ROOT
from tests.support.stack import Stack


def test_hash_ids_map_to_tokens_keeping_the_prefix_structure(tmp_path, tiny):
    trace = tmp_path / "t.jsonl"
    recs = [{"timestamp": 0, "input_length": 2048, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 1500, "input_length": 1400, "output_length": 7, "hash_ids": [1, 2, 9]},
            {"timestamp": 2000, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 8]},
            {"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [7]}]
    trace.write_text("\n".join(json.dumps(r) for r in recs))
    reqs = workloads.mooncake(trace, k=16, time_scale=0.5)
    # 2048*16/512, round(1400*16/512), 1536*16/512, 512*16/512
    assert [len(r.prompt_ids) for r in reqs] == [64, 44, 48, 16]
    assert [r.arrival_s for r in reqs] == [0.0, 0.75, 1.0, 1.5] and [r.max_tokens for r in reqs] == [5, 7, 2, 1]
    from pdserve.engine.engine import LLMEngine

    profile = LLMEngine(tiny).profile
    a, b, d, c = (block_hashes(r.prompt_ids, profile) for r in reqs)
    assert len(b) == 2 and b == a[:2]  # the partial third block of b is not a block
    assert d[:2] == a[:2] and d[2] != a[2]  # shared exactly as far as hash_ids agree
    assert not set(c) & set(a)
    assert workloads.block_tokens(2, 16) == reqs[0].prompt_ids[16:32] == reqs[1].prompt_ids[16:32]


def test_real_mooncake_trace_loads():
    reqs = workloads.mooncake(max_requests=50, k=16)
    assert len(reqs) == 50 and reqs[0].arrival_s == 0.0
    assert all(0 <= t < 250 for r in reqs for t in r.prompt_ids)


def test_percentiles_attainment_and_goodput_on_known_inputs():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert math.isnan(percentile([], 50))
    recs = [Record(0, 10, 4, ok=True, ttft_ms=t, tpot_ms=p, output_tokens=4) for t, p in
            [(100, 10), (200, 20), (300, 30), (400, 40)]] + [Record(0, 10, 4, ok=False)]
    assert attainment(recs, ttft_ms=250, tpot_ms=25) == 2 / 5
    assert attainment(recs, ttft_ms=1000, tpot_ms=100) == 4 / 5
    assert goodput({1.0: 0.99, 2.0: 0.95, 4.0: 0.91, 8.0: 0.5}) == 4.0
    assert goodput({1.0: 0.5}) == 0.0
    assert goodput({4.0: 0.95, 1.0: 0.95, 2.0: 0.85}) == 1.0  # 4/s passing above a failed 2/s does not count
    s = summarize(recs, wall_s=2.0, ttft_slo_ms=250, tpot_slo_ms=25)
    assert s["ttft_ms"]["p50"] == 250 and s["ok"] == 4 and s["errors"] == 1 and s["throughput_rps"] == 2.0
    assert math.isnan(s["router_ttft_ms"]["p50"])  # (not measured: absent from these records)
    assert "ttft_estimate_error_ms" not in s
    # What the router's TTFT estimate missed by, where it gave one.
    est = [Record(0, 10, 4, ok=True, router_ttft_ms=t, estimated_ttft_ms=e) for t, e in
           [(150, 100), (100, 150), (400, 100), (90, 0)]]
    assert summarize(est, 1.0, 250, 25)["ttft_estimate_error_ms"] == {"p10": -30.0, "p50": 50.0, "p90": 250.0}
    # Refusals apart from other errors, with how fast they came.
    failed = [Record(0, 10, 4, error="ResourceExhausted: RESOURCE_EXHAUSTED: queue full", error_ms=ms)
              for ms in (2.0, 4.0)] + [Record(0, 10, 4, error="PdserveError: INTERNAL: boom", error_ms=900.0)]
    s = summarize(recs + failed, wall_s=2.0, ttft_slo_ms=250, tpot_slo_ms=25)
    assert (s["errors"], s["refused"], s["other_errors"]) == (4, 2, 2)
    assert s["refusal_ms"] == {"p50": 3.0, "p99": pytest.approx(3.98)}
    # Each refusal under the rule that made it, from the router's own messages.
    said = [over_slo(2500, 0, 2000), over_slo(1500, 800, 2000), "no decode worker can admit 3 KV blocks now (2 "
            "healthy), and 64 requests are already queued for room: retry in about 2000 ms",
            "no decode worker can admit 3 KV blocks now (2 healthy) after 2 s in the admission queue"]
    why = [Record(0, 10, 4, error=f"ResourceExhausted: RESOURCE_EXHAUSTED: {m}", error_ms=ms)
           for m, ms in zip(said, (1.0, 800.0, 2.0, 2000.0), strict=True)]
    s = summarize(why + failed[2:], wall_s=2.0, ttft_slo_ms=250, tpot_slo_ms=25)
    assert {k: (v["n"], v["p50_ms"]) for k, v in s["refusals_by_reason"].items()} == {
        "over_slo": (1, 1.0), "over_slo_after_waiting": (1, 800.0), "queue_full": (1, 2.0),
        "queue_timeout": (1, 2000.0)}


def test_pooled_lru_bound_on_a_handmade_trace():
    chains = [["a", "b", "c"], ["a", "b", "d"], ["e"], ["a", "x"], ["e", "f"]]
    # Capacity 10 (never evicts): hits a,b (req 2) + a (req 4) + e (req 5) = 4 of 11 blocks.
    assert lru_hit_ratio(chains, 10) == pytest.approx(4 / 11)
    # Capacity 3: after req 2 the cache is b,c... evictions break the later reuse exactly as LRU says.
    assert lru_hit_ratio(chains, 3) == pytest.approx(3 / 11)
    assert lru_hit_ratio(chains, 0) == 0.0


def test_short_real_run_fills_every_field(shared_redis_url, tmp_path):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}").start(1, 1)
    s.start_router("--http-port", "0", "--http-port-file", str(tmp_path / "http-port"))
    try:
        s.wait_pool(2)
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--router", s.router.address,
                              "--workload", "shared-prefix", "--max-requests", "6", "--rates", "4,8",
                              "--max-output", "16", "--out", str(tmp_path), "--json"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        doc = json.loads(out.stdout)
        summ = doc["summary"]
        assert summ["requests"] == 6 and summ["ok"] == 6
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert all(summ[name][q] > 0 for q in ("p50", "p90", "p99")), name
        assert summ["throughput_rps"] > 0 and summ["prefix_hit_ratio_tokens"] > 0
        assert set(doc["sweep"]) == {"4.0", "8.0"} and "goodput_rps" in doc and doc["targets"] == []
        full = json.loads((tmp_path / "serve.json").read_text())
        assert len(full["records"]) == 6 and all(r["ok"] and r["output_tokens"] == 16 for r in full["records"])
        # One prefill worker: the best-placed worker is the one chosen, and the shared prefix was expected.
        recs = full["records"]
        assert [r["best_hit_tokens"] for r in recs] == [r["expected_hit_tokens"] for r in recs]
        assert sum(r["expected_hit_tokens"] for r in recs) > 0
        report = (tmp_path / "report.md").read_text()
        assert "| ttft_ms |" in report and "Goodput" in report
        pngs = ["ttft_cdf.png", "itl_cdf.png", "attainment.png"]
        assert doc["plots"] == pngs
        for name in pngs:
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        # The same workload through the OpenAI API: the same records, the same tokens counted.
        url = f"http://127.0.0.1:{int((tmp_path / 'http-port').read_text())}/v1"
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--api", "openai", "--url", url,
                              "--workload", "shared-prefix", "--max-requests", "6", "--max-output", "16", "--out",
                              str(tmp_path / "openai"), "--no-plots", "--json"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        via_http = json.loads((tmp_path / "openai" / "serve.json").read_text())
        assert [(r["ok"], r["output_tokens"], r["prompt_tokens"], len(r["itl_ms"])) for r in via_http["records"]] == [
            (True, 16, r["prompt_tokens"], 15) for r in recs]
        assert all(r["ttft_ms"] > 0 and r["prefill_worker"] == s.prefills[0].address for r in via_http["records"])
    finally:
        s.stop()


def test_pooled_bound_over_token_prefixes_matches_block_structure():
    from pdserve.bench.compare_bench import pooled_bound
    from pdserve.bench.workloads import BenchRequest

    a = list(range(48))
    b = a[:32] + [999] * 16
    reqs = [BenchRequest(0, a, 1), BenchRequest(1, b, 1), BenchRequest(2, a, 1)]
    # Unbounded: b hits 2 of 3, the repeat of a hits 3 of 3: 5 of 9 blocks.
    assert pooled_bound(reqs, 100, 16) == pytest.approx(5 / 9)
    # Room for 3 blocks: b evicts a's third block -> the repeat of a hits its first 2 only.
    assert pooled_bound(reqs, 3, 16) == pytest.approx(4 / 9)


def test_pinned_deployments_give_each_pool_or_worker_cpus_of_its_own():
    from pdserve.bench.deploy import worker_cpus

    assert worker_cpus("disagg", 1, 1, [0, 1]) == {("prefill", 0): "0", ("decode", 0): "1"}
    assert worker_cpus("colocated", 1, 1, [0, 1]) == {("decode", 0): "0", ("decode", 1): "1"}
    assert worker_cpus("colocated", 2, 1, [4, 5]) == {("decode", 0): "4", ("decode", 1): "5", ("decode", 2): "4"}
    eight = worker_cpus("disagg", 3, 1, list(range(8)))
    assert eight[("prefill", 0)] == eight[("prefill", 2)] == "0,1,2,3,4,5" and eight[("decode", 0)] == "6,7"
    assert worker_cpus("disagg", 9, 1, [0, 1, 2])[("decode", 0)] == "2"  # the decode pool always keeps one
    with pytest.raises(ValueError, match="two CPUs"):
        worker_cpus("disagg", 1, 1, [0])


def test_api_bench_reports_both_paths_and_its_targets():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "api", "--max-requests", "4", "--max-output",
                          "4", "--rounds", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    for api in ("grpc", "http", "http_httpx"):
        assert (doc[api]["ok"], doc[api]["output_tokens"]) == (4, 16) and doc[api]["router_cpu_s"] >= 0
    # (the CPU ratio only where the router's CPU clock, in 10 ms ticks, saw each side's tokens)
    measured = all("router_cpu_us_per_token" in doc[api] for api in ("grpc", "http"))
    assert [t["name"] for t in doc["targets"]] == ["http_added_ttft_p50", "http_added_itl_p50"] + (
        ["http_router_cpu_per_token_ratio"] if measured else [])
    assert doc["targets"][0]["value"] == pytest.approx(doc["http"]["ttft_ms_p50"] - doc["grpc"]["ttft_ms_p50"],
                                                       abs=1e-3)


def test_two_store_nodes_isolated_and_shared_get_the_same_total_capacity():
    from pdserve.bench.compare_bench import node_specs
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["bench", "compare", "--store-nodes", "2", "--prefill", "4", "--decode", "2",
                                      "--store-cache-tokens", "4096", "--cluster-segment-tokens", "16384"])
    (iso_name, iso), (shared_name, shared) = node_specs(args)
    assert (iso_name, iso.store_nodes, iso.store_cache_tokens, iso.cluster_segment_tokens) == (
        "isolated", 2, 4096 + 2 * 16384, 0)
    assert (shared_name, shared.store_nodes, shared.store_cache_tokens, shared.cluster_segment_tokens) == (
        "shared", 2, 4096, 16384)
    assert (iso.policy, shared.policy, iso.prefill, shared.decode) == ("cache_aware", "cache_aware", 4, 2)


def test_compare_on_two_store_nodes_runs_both_and_reports_against_the_pooled_bound(tmp_path):
    """A short real run (mock engine, a real mooncake_master, 2 store nodes, Redis): both
    topologies serve every request, and the target is the shared run's ratio to the bound."""
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "compare", "--workload", "shared-prefix",
                          "--engine", "mock", "--prefill", "2", "--decode", "2", "--store-nodes", "2",
                          "--max-requests", "12", "--max-output", "4", "--prefix-tokens", "512",
                          "--worker-cache-tokens", "2048", "--store-cache-tokens", "4096",
                          "--cluster-segment-tokens", "4096", "--out", str(tmp_path), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    runs = doc["runs"]
    assert [r["topology"] for r in runs] == ["2 nodes, isolated", "2 nodes, shared"]
    assert [(r["summary"]["ok"], r["summary"]["requests"]) for r in runs] == [(12, 12), (12, 12)]
    assert runs[0]["cached_tokens_cluster"] == 0  # no cluster tier there
    assert [r["ttft_coefficients"]["samples"] for r in runs] == [12, 12]  # every prefill observed by the router
    assert doc["pooled_capacity_blocks"] == (2 * 2048 + 4096 + 2 * 4096) // 16
    (target,) = [t for t in doc["targets"] if t["name"] == "shared_cluster_hit_vs_pooled_bound_2_nodes"]
    assert target["value"] == pytest.approx(runs[1]["block_hit_ratio"] / doc["pooled_bound"], abs=1e-4)
    assert "2 nodes, shared | cache_aware | 12/12" in (tmp_path / "compare.md").read_text()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a router CPU of its own needs two CPUs")
def test_compare_can_give_the_router_and_the_load_generator_a_cpu_of_their_own(tmp_path):
    """--router-cpus: the router and the client on those CPUs, the store and the workers on the
    rest (read from the running processes); every request served, in each of two rounds, and the
    store's calls counted per request (one Watch each: decode's)."""
    mine = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "compare", "--workload", "shared-prefix",
                          "--engine", "mock", "--prefill", "1", "--decode", "1", "--modes", "disagg",
                          "--policies", "cache_aware", "--max-requests", "6", "--max-output", "4",
                          "--prefix-tokens", "256", "--router-cpus", str(mine[0]), "--rounds", "2",
                          "--out", str(tmp_path), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = json.loads(out.stdout)["runs"]
    assert (run["rounds"], run["summary"]["ok"], run["summary"]["requests"]) == (2, 12, 12)
    assert run["store_calls_per_request"]["Watch"] == 1.0 and len(run["stores"]) == 2
    assert run["cpus"] == {"kvstore-0": mine[1:], "prefill-0": mine[1:], "decode-0": mine[1:], "router": mine[:1],
                           "client": mine[:1]}
    assert sorted(os.sched_getaffinity(0)) == mine  # (the test's own process is untouched)
