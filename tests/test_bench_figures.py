"""The benches' figures and targets from known inputs: nothing invented where nothing was measured."""

from __future__ import annotations

import math

from pdserve.bench.serve_stats import Record


def _served(n: int, tokens: int = 4) -> list[Record]:
    return [Record(0, 10, tokens, ok=True, ttft_ms=10.0 + i, output_tokens=tokens, itl_ms=[1.0] * (tokens - 1))
            for i in range(n)]


def test_api_bench_router_cpu_per_token_only_where_measured():
    from pdserve.bench.api_bench import api_figures, http_minus_grpc

    g = api_figures(_served(4), cpu_s=0.02)
    assert g["router_cpu_us_per_token"] == 0.02 / 16 * 1e6
    # No token streamed (every request failed): no CPU per token, not the CPU seconds x 1e6.
    failed = [Record(0, 10, 4, error="boom")] * 4
    assert "router_cpu_us_per_token" not in api_figures(failed, cpu_s=0.05)
    # The router's CPU clock (10 ms ticks) saw nothing on gRPC: no ratio, not HTTP's figure / 1e-9.
    idle = api_figures(_served(4), cpu_s=0.0)
    assert "router_cpu_us_per_token" not in idle
    delta, targets = http_minus_grpc(idle, api_figures(_served(4), cpu_s=0.01))
    assert "router_cpu_per_token_ratio" not in delta
    assert [t.name for t in targets] == ["http_added_ttft_p50", "http_added_itl_p50"]
    delta, targets = http_minus_grpc(g, api_figures(_served(4), cpu_s=0.03))
    assert delta["router_cpu_per_token_ratio"] == 1.5 and not targets[2].met
    # A latency HTTP never measured is NaN there, and its target is not met.
    _, targets = http_minus_grpc(g, api_figures(failed, cpu_s=0.05))
    assert math.isnan(targets[0].value) and not targets[0].met


def test_capacity_pools_need_a_decode_batch_within_the_tpot_limit():
    from pdserve.bench.capacity_bench import workers_needed

    # 2 req/s of 1000 prompt and 100 output tokens; prefill 4000 tok/s; 8 sequences at 50 ms a step.
    assert workers_needed(2.0, 1000, 100, 4000, 8, 50.0) == {
        "prefill_workers_needed": 0.5, "decode_workers_needed": 2 * 100 * 0.05 / 8, "p_to_d_ratio": 0.5 / 1.25}
    # No batch met the TPOT limit: no decode pool and no P:D (before: an infinite pool and P:D 0.0).
    assert workers_needed(2.0, 1000, 100, 4000, 0, math.nan) == {"prefill_workers_needed": 0.5}


def test_a_request_served_without_a_measured_ttft_does_not_meet_the_slo():
    from pdserve.bench.serve_stats import attainment, meets_slo

    # Served, one token counted from usage, but no chunk carried text: TTFT never measured.
    unseen = Record(0, 10, 1, ok=True, output_tokens=1)
    assert math.isnan(unseen.ttft_ms) and not meets_slo(unseen, 2000, 100)
    assert attainment([unseen, *_served(1, tokens=1)], 2000, 100) == 0.5


def test_no_requests_or_blocks_measured_give_nan_not_zero():
    from pdserve.bench.compare_bench import block_hit_ratio, pooled_bound
    from pdserve.bench.serve_stats import attainment, goodput, lru_hit_ratio, summarize

    refused = [Record(0, 10, 4, error="ResourceExhausted: RESOURCE_EXHAUSTED: queue full", error_ms=1.0)] * 3
    s = summarize(refused, wall_s=1.0, ttft_slo_ms=2000, tpot_slo_ms=100)
    assert math.isnan(s["prefix_hit_ratio_tokens"])  # nothing served: no hit ratio (before: 0.0)
    assert s["throughput_rps"] == 0.0 and s["slo"]["attainment"] == 0.0  # (measured: none served)
    assert math.isnan(attainment([], 2000, 100)) and math.isnan(summarize([], 0.0, 2000, 100)["throughput_rps"])
    # A rate whose attainment was not measured does not pass, nor does any rate above it.
    assert goodput({1.0: 0.95, 2.0: math.nan, 4.0: 0.95}) == 1.0
    assert math.isnan(block_hit_ratio(refused, 16)) and math.isnan(lru_hit_ratio([], 10))
    assert math.isnan(pooled_bound([], 10, 16))
    served = [Record(0, 40, 4, ok=True, cached_local=16)]
    assert block_hit_ratio(served, 16) == 0.5
    from pdserve.bench.handoff_bench import hidden_fraction

    assert hidden_fraction(10.0, 2.5) == 0.75 and math.isnan(hidden_fraction(0.0, 0.0))


def test_json_output_is_strict_json_with_not_measured_as_null(capsys, tmp_path):
    import json

    from pdserve.bench.report import Target, dumps, emit

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"not JSON: {c}")))

    emit({"p50": math.nan, "rows": [{"x": math.inf}], "sweep": {4.0: 0.5}}, [Target("t", math.nan, "ms", 1.0, "<=")],
         True, [])
    doc = strict(capsys.readouterr().out)
    assert doc["p50"] is None and doc["rows"] == [{"x": None}] and doc["sweep"] == {"4.0": 0.5}
    assert doc["targets"][0]["value"] is None and doc["targets"][0]["met"] is False
    assert strict(dumps({"a": [math.nan, 1.5]})) == {"a": [None, 1.5]}


class _FakeStream:
    """What httpx's client.stream gives: a 200 and the SSE lines, each chunk `delay_s` apart."""

    def __init__(self, lines: list[str], delay_s: float):
        self.lines, self.delay_s, self.status_code = lines, delay_s, 200

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def aiter_lines(self):
        import asyncio

        for line in self.lines:
            await asyncio.sleep(self.delay_s)
            yield line


def test_openai_load_records_one_gap_per_token_as_the_grpc_load_does():
    """A router streaming 4 tokens a chunk (--stream-interval 4): the gRPC client yields each token
    as an event, so its ITL has a gap per token; the HTTP load had one per chunk, a population
    whose p50 was the chunk's gap, compared by bench api against gRPC's per-token p50."""
    import asyncio
    import json

    from pdserve.bench.openai_load import openai_one
    from pdserve.bench.workloads import BenchRequest

    chunks = [[1], [2, 3, 4, 5], [6, 7, 8, 9]]
    lines = [f"data: {json.dumps({'choices': [{'text': 'x', 'pdserve': {'token_ids': ids}}]})}" for ids in chunks]
    lines += ["data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 9}}), "data: [DONE]"]

    class Client:
        def stream(self, *a, **kw):
            return _FakeStream(lines, 0.02)

    rec = asyncio.run(openai_one(Client(), "http://x/v1", "m", BenchRequest(0.0, [1, 2], 9), 0.0, 10.0))
    assert rec.ok and rec.output_tokens == 9 and len(rec.itl_ms) == 8
    gaps = rec.itl_ms
    assert gaps[1:4] == gaps[5:] == [0.0] * 3  # the same chunk's tokens
    assert gaps[0] >= 15 and gaps[4] >= 15  # the gap between chunks, once each


def test_compare_pooled_bound_is_over_the_requests_the_load_sent():
    """run_load leaves out arrivals after --max-seconds (at the reported pass's own Poisson times
    with --rates); the bound the realised hit ratio is judged against is over those requests."""
    from argparse import Namespace

    from pdserve.bench.compare_bench import pooled_bound, sent_requests
    from pdserve.bench.workloads import BenchRequest, with_poisson_arrivals

    a, b = list(range(32)), list(range(100, 132))
    reqs = [BenchRequest(0.0, a, 1), BenchRequest(1.0, b, 1), BenchRequest(5.0, a, 1), BenchRequest(6.0, b, 1)]
    sent = sent_requests(reqs, Namespace(rates="", rate=0.0, max_seconds=2.0))
    assert sent == reqs[:2] and pooled_bound(sent, 100, 16) == 0.0  # (all of reqs: 0.5)
    swept = sent_requests(reqs, Namespace(rates="1,8", rate=0.0, max_seconds=0.3))
    assert swept == [r for r in with_poisson_arrivals(reqs, 8.0) if r.arrival_s <= 0.3]


def test_compare_router_decision_p99_is_the_worst_measured_whatever_the_order():
    from pdserve.bench.compare_bench import _router_target

    def run(p99, mode="disagg"):
        return {"mode": mode, "route_ms": {"p99": p99}}

    for runs in ([run(math.nan), run(3.0), run(1.0)], [run(3.0), run(math.nan), run(1.0)]):
        (t,) = _router_target(runs)
        assert t.value == 3.0 and not t.met  # (before: NaN first gave NaN; NaN later was passed over)
    assert _router_target([run(math.nan), run(9.0, "colocated")]) == []


def test_handoff_itl_percentiles_are_the_benches_percentile():
    """Its own nearest-rank pct rounded half to even: p50 of 4 gaps was the 3rd, of 2 gaps the 1st."""
    from pdserve.bench.handoff_bench import pct
    from pdserve.bench.serve_stats import percentile

    for xs in ([1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [float(x) for x in range(1, 101)]):
        for q in (50, 99):
            assert pct(xs, q) == percentile(xs, q)
    assert math.isnan(pct([], 99))


def test_a_refusal_over_the_openai_api_counts_as_refused():
    """The HTTP API answers a refusal for load 429 (gRPC's RESOURCE_EXHAUSTED); bench serve --api
    openai counted those among other errors, and no refusal reason or latency was reported."""
    import json

    from pdserve.bench.serve_stats import summarize

    body = json.dumps({"error": {"message": "no decode worker can admit 3 KV blocks now (2 healthy), and 64 "
                                 "requests are already queued for room: retry in about 2000 ms",
                                 "type": "rate_limit_error", "param": None, "code": "resource_exhausted"}})
    recs = [Record(0, 10, 4, error=f"RuntimeError: HTTP 429: {body}", error_ms=2.0),
            Record(0, 10, 4, error="RuntimeError: stream error: HTTP 429: store full", error_ms=4.0),
            Record(0, 10, 4, error="RuntimeError: HTTP 500: internal error", error_ms=9.0)]
    s = summarize(recs, wall_s=1.0, ttft_slo_ms=2000, tpot_slo_ms=100)
    assert (s["refused"], s["other_errors"]) == (2, 1) and s["refusal_ms"]["p50"] == 3.0
    assert {k: v["n"] for k, v in s["refusals_by_reason"].items()} == {"queue_full": 1, "store_full": 1}
    # A refusal that came as the stream's error event keeps its status in the record.
    import asyncio

    from pdserve.bench.openai_load import openai_one
    from pdserve.bench.workloads import BenchRequest

    lines = ["data: " + json.dumps({"error": {"message": "store full", "type": "rate_limit_error", "status": 429}})]

    class Client:
        def stream(self, *a, **kw):
            return _FakeStream(lines, 0.0)

    rec = asyncio.run(openai_one(Client(), "http://x/v1", "m", BenchRequest(0.0, [1], 4), 0.0, 10.0))
    assert not rec.ok and rec.error == "RuntimeError: stream error: HTTP 429: store full"


def test_compare_goodput_target_names_the_first_disagg_policy_and_calls_need_a_served_request():
    from pdserve.bench.compare_bench import _calls_per_request, _goodput_target

    runs = [{"mode": "disagg", "policy": "cache_aware", "goodput_rps": 3.0},
            {"mode": "disagg", "policy": "least_loaded", "goodput_rps": 1.0},
            {"mode": "colocated", "policy": "least_loaded", "goodput_rps": 1.5}]
    [t] = _goodput_target(runs)
    assert (t.name, t.value) == ("goodput_disagg_cache_aware_vs_colocated", 2.0)
    assert _goodput_target([runs[0], {**runs[2], "goodput_rps": math.nan}]) == []
    assert _goodput_target(runs[:2]) == []
    stores = [{"calls": {"Watch": 6, "Get": 3}}, {"calls": {"Watch": 2}}]
    assert _calls_per_request(stores, 4) == {"Watch": 2.0, "Get": 0.75}
    assert _calls_per_request(stores, 0) == {}


def test_kvstore_store_vs_raw_is_over_the_repeats_the_raw_moves_were_timed_beside():
    """(The store's median was over every repeat, the raw's over those with contiguous slots.)"""
    from pdserve.bench.kvstore_bench import vs_raw

    assert vs_raw([1.0, 9.0, 9.0], [True, False, False], int(2e9), 1.0) == 2.0
    assert vs_raw([1.0, 3.0, 9.0], [True, True, True], int(2e9), 2.0) == 2e9 / 3.0 / 1e9 / 2.0


def test_engine_bench_leaves_out_a_transformers_decode_time_that_is_not_positive(monkeypatch):
    """(Two generate() calls' difference at or below 0 gave a negative or infinite tok/s, and a
    ratio to match.)"""
    from pdserve.bench import engine_bench
    from pdserve.model.loader import load_model

    loaded = load_model("tiny")
    times = iter([0.010, 0.012, 0.030, 0.010])  # (steps + 1, then 1 token): -2 ms, then 20 ms
    monkeypatch.setattr(engine_bench, "_hf_generate", lambda hf, ids, n: next(times))
    hf = type("HF", (), {"device": "cpu"})()
    assert math.isnan(engine_bench.hf_decode(hf, loaded, 2, 8, 4))
    assert math.isclose(engine_bench.hf_decode(hf, loaded, 2, 8, 4), 2 * 4 / 0.020)
    row = engine_bench._row({"pdserve": [100.0, 120.0], "transformers": [50.0, math.nan]})
    assert row == {"pdserve_tok_s": 110.0, "pdserve_min_tok_s": 100.0}
    assert engine_bench._row({"pdserve": [100.0], "transformers": [50.0]})["ratio"] == 2.0
