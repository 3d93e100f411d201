"""The prefill policy's cost model: the TTFT estimate, the choices it makes, the coefficients
fitted to what prefills report, and what the SLO check learns estimates miss by. Pure logic."""

from __future__ import annotations

import itertools
from dataclasses import replace

from services.router.policy import (
    Coefficients,
    DecodeCandidate,
    Policy,
    PrefillCandidate,
    PrefillCost,
    estimate_ttft_ms,
    over_slo,
)
from services.router.stage_latency import StageLatency


def test_ttft_estimate_and_choices():
    coef = Coefficients(prefill_ms_per_token=0.1, fetch_ms_per_token=0.01, request_ms=5.0)
    idle_cached = PrefillCandidate("p0", queued_tokens=0, local_hit_tokens=800, inflight=0)
    busy_cold = PrefillCandidate("p1", queued_tokens=2000, local_hit_tokens=0, inflight=3, queued_requests=3)
    est, local, fetched = estimate_ttft_ms(idle_cached, 1000, store_hit_tokens=960, coef=coef)
    assert (round(est, 6), local, fetched) == (round(5 + 40 * 0.1 + 160 * 0.01, 6), 800, 160)
    est1, _, fetched1 = estimate_ttft_ms(busy_cold, 1000, store_hit_tokens=960, coef=coef)
    assert fetched1 == 960 and round(est1, 6) == round(4 * 5 + (2000 + 40) * 0.1 + 960 * 0.01, 6)
    assert Policy("cache_aware").choose_prefill([busy_cold, idle_cached], 1000, 960, coef).worker_id == "p0"
    assert Policy("least_loaded").choose_prefill([busy_cold, idle_cached], 1000, 960, coef).worker_id == "p0"
    rr = Policy("round_robin")
    assert [rr.choose_prefill([busy_cold, idle_cached], 10, 0, coef).worker_id for _ in range(3)] == ["p1", "p0",
                                                                                                     "p1"]
    # A full prompt hit still computes one token: the estimate never reaches zero compute.
    assert estimate_ttft_ms(idle_cached, 800, 0, coef)[1] == 799
    # The cluster's blocks after its store's are priced at their own rate, and count as fetched.
    clustered = replace(idle_cached, store_hit_tokens=900, cluster_hit_tokens=64)
    est, local, fetched = estimate_ttft_ms(clustered, 1000, 0, coef)
    assert (round(est, 6), local, fetched) == (round(5 + 36 * 0.1 + 100 * 0.01 + 64 * 0.03, 6), 800, 164)
    # ... and never past the prompt's last token.
    assert estimate_ttft_ms(replace(clustered, cluster_hit_tokens=4096), 1000, 0, coef)[2] == 199
    # A long queue outweighs a cache hit; the choice says what it gave up.
    busy_cached = PrefillCandidate("p2", queued_tokens=5000, local_hit_tokens=900, inflight=2)
    idle_cold = PrefillCandidate("p3", queued_tokens=0, local_hit_tokens=0, inflight=0)
    c = Policy("cache_aware").choose_prefill([busy_cached, idle_cold], 1000, 0, coef)
    assert (c.worker_id, c.expected_local_tokens, c.expected_store_tokens, c.best_hit_tokens) == ("p3", 0, 0, 900)


def test_a_cached_prompt_stays_where_its_cache_is_unless_the_queue_costs_more_than_the_pool_saves():
    """cache_aware prices a worker by its TTFT estimate plus the compute the pool spends on what
    it does not hold: a cached worker whose queue makes its TTFT 5 ms longer still gets the
    prompt (900 tokens it need not compute), and the choice reports the TTFT estimate alone."""
    coef = Coefficients(prefill_ms_per_token=0.1, fetch_ms_per_token=0.01, request_ms=5.0)
    cached = PrefillCandidate("p0", queued_tokens=900, local_hit_tokens=900, inflight=1, queued_requests=1)
    cold = PrefillCandidate("p1", queued_tokens=0, local_hit_tokens=0, inflight=0)
    assert round(estimate_ttft_ms(cached, 1000, 0, coef)[0], 6) == round(2 * 5 + (900 + 100) * 0.1, 6)  # 110
    assert round(estimate_ttft_ms(cold, 1000, 0, coef)[0], 6) == round(5 + 1000 * 0.1, 6)  # 105
    c = Policy("cache_aware").choose_prefill([cold, cached], 1000, 0, coef)
    assert (c.worker_id, round(c.estimated_ttft_ms, 6), c.expected_local_tokens) == ("p0", 110.0, 900)
    # A queue that costs more than the 90 ms of compute the hit saves sends it to the cold worker.
    longer = replace(cached, queued_tokens=1900)  # TTFT 210 + 10 against 105 + 100
    assert Policy("cache_aware").choose_prefill([cold, longer], 1000, 0, coef).worker_id == "p1"


def test_ties_rotate_over_the_pool_so_every_cache_fills():
    """Prompts cached nowhere, on an idle pool, go to the worker chosen longest ago, not always
    the first by id; a prompt with a hit still goes where its hit is."""
    coef = Coefficients(prefill_ms_per_token=0.1, fetch_ms_per_token=0.01)
    cold = [PrefillCandidate(w, queued_tokens=0, local_hit_tokens=0, inflight=0) for w in ("p0", "p1", "p2")]
    for name in ("cache_aware", "least_loaded"):
        pol = Policy(name)
        assert [pol.choose_prefill(cold, 100, 0, coef).worker_id for _ in range(4)] == ["p0", "p1", "p2", "p0"], name
    pol = Policy("cache_aware")
    assert pol.choose_prefill(cold, 100, 0, coef).worker_id == "p0"
    warm_p0 = [PrefillCandidate("p0", 0, 64, 0), *cold[1:]]
    assert [pol.choose_prefill(warm_p0, 100, 0, coef).worker_id for _ in range(2)] == ["p0", "p0"]
    assert pol.choose_prefill(cold, 100, 0, coef).worker_id == "p1"
    d = Policy.choose_decode([DecodeCandidate("d0", 10, 0), DecodeCandidate("d1", 50, 9),
                              DecodeCandidate("d2", 50, 2)], blocks_needed=20)
    assert d.worker_id == "d2" and Policy.choose_decode([DecodeCandidate("d0", 10, 0)], 20) is None


def test_a_queue_of_short_cached_prompts_is_priced_by_its_requests_too():
    """Each prefill costs a fixed part whatever its length: twenty queued prompts of 10 tokens to
    compute outweigh a 650-token miss on an idle worker (priced by tokens alone they would not,
    and a burst sharing one prefix would all go where the prefix is)."""
    coef = Coefficients(prefill_ms_per_token=0.08, fetch_ms_per_token=0.01, request_ms=20.0)
    herd = PrefillCandidate("p0", queued_tokens=20 * 10, local_hit_tokens=600, inflight=20, queued_requests=20)
    idle = PrefillCandidate("p1", queued_tokens=0, local_hit_tokens=0, inflight=0)
    choice = Policy("cache_aware").choose_prefill([herd, idle], 650, 0, coef)
    assert (choice.worker_id, choice.queue) == ("p1", PrefillCost(0, 0, 0))
    choice = Policy("cache_aware").choose_prefill([replace(herd, queued_requests=0), idle], 650, 0, coef)
    assert (choice.worker_id, choice.queue) == ("p0", PrefillCost(0, 200, 0))


def test_the_cost_coefficients_are_fitted_to_the_times_to_first_token_workers_report():
    """Fitted to what the estimate predicts: each prefill's time to its first token against the
    queue it joined (requests, tokens) and what it fetched from its store and from the cluster;
    first at 32 samples, then every 16."""
    coef = Coefficients(prefill_ms_per_token=1.0, fetch_ms_per_token=1.0, request_ms=1.0, cluster_ms_per_token=1.0)
    shapes = itertools.cycle([(1, 16, 0, 0), (3, 500, 256, 32), (2, 1000, 0, 512), (1, 64, 1024, 0),
                              (5, 2000, 512, 128), (1, 300, 64, 16), (2, 50, 0, 256)])
    samples = [PrefillCost(*shape) for shape in itertools.islice(shapes, 32)]
    truth = Coefficients(prefill_ms_per_token=0.08, fetch_ms_per_token=0.02, request_ms=12.0,
                         cluster_ms_per_token=0.05)
    for cost in samples[:31]:
        coef.observe(cost, truth.ms(cost))
    assert (coef.samples, coef.request_ms) == (31, 1.0)
    coef.observe(samples[31], truth.ms(samples[31]))
    assert [round(getattr(coef, n), 6) for n in Coefficients.NAMES] == [12.0, 0.08, 0.02, 0.05]
    # No store hits in the window: the fetch coefficient cannot be told, and keeps its value.
    nofetch = Coefficients(fetch_ms_per_token=0.5)
    for i in range(32):
        nofetch.observe(PrefillCost(1 + i % 3, 10 * i + 1, 0), 4.0 * (1 + i % 3) + 0.1 * (10 * i + 1))
    assert [round(getattr(nofetch, n), 6) for n in Coefficients.NAMES] == [4.0, 0.1, 0.5, 0.03]


def test_fetch_costs_are_fitted_to_the_loads_prefills_measure_not_to_their_times_to_first_token():
    """Prefills that fetched from the cluster came at busy times (an unpriced 40 ms each): fitted
    to times to first token, a cluster token is priced at ten times what it costs. Fitted to the
    loads each prefill measured (a fixed 1.5 ms, then per token), the fetch costs are what the
    loads cost, and request_ms and prefill_ms_per_token are fitted to what is left."""
    shapes = itertools.cycle([(1, 16, 0, 0), (3, 500, 256, 32), (2, 1000, 0, 512), (1, 64, 1024, 0),
                              (5, 2000, 512, 128), (1, 300, 64, 16), (2, 50, 0, 256)])
    samples = [PrefillCost(*shape) for shape in itertools.islice(shapes, 64)]
    truth = Coefficients(prefill_ms_per_token=0.08, fetch_ms_per_token=0.002, request_ms=12.0,
                         cluster_ms_per_token=0.005)
    measured, blind = Coefficients(), Coefficients()
    for cost in samples:
        load_ms = 1.5 + cost.fetched * 0.002 + cost.cluster * 0.005
        ttft_ms = truth.ms(cost) + 1.5 + (40.0 if cost.cluster else 0.0)
        measured.observe(cost, ttft_ms, load_ms)
        blind.observe(cost, ttft_ms)
    assert blind.cluster_ms_per_token > 10 * truth.cluster_ms_per_token
    assert (round(measured.fetch_ms_per_token, 6), round(measured.cluster_ms_per_token, 6)) == (0.002, 0.005)
    assert measured.fitted == set(Coefficients.NAMES)
    assert measured.cluster_ms_per_token < measured.prefill_ms_per_token


def test_the_slo_check_learns_what_estimates_miss_by():
    """The median of the recent misses (measured less estimated), once there are enough: the
    SLO check adds it, since the cheapest of several noisy estimates is, as a rule, short."""
    coef = Coefficients()
    for _ in range(Coefficients.MIN_SAMPLES - 1):
        coef.missed(300.0)
    assert coef.miss_ms == 0.0  # (too few yet)
    coef.missed(-50.0)
    assert coef.miss_ms == 300.0 and coef.gauges()["router_ttft_miss_ms"] == 300.0  # (in /metrics)
    for _ in range(Coefficients.WINDOW):
        coef.missed(-20.0)
    assert coef.miss_ms == -20.0  # (the recent ones only: estimates that run long lower it)


def test_what_estimates_missed_by_counts_for_a_few_seconds_only():
    """Only admitted requests are measured: a correction above the SLO would refuse every
    request and never be lowered. Misses older than MISS_HORIZON_S no longer count, so a router
    that refused everything admits again once its last measurements have aged."""
    now = [100.0]
    coef = Coefficients(clock=lambda: now[0])
    for _ in range(Coefficients.MIN_SAMPLES):
        coef.missed(2500.0)
    assert coef.miss_ms == 2500.0
    assert over_slo(100.0 + coef.miss_ms, 0.0, 2000.0)  # refused, however cheap
    now[0] += Coefficients.MISS_HORIZON_S - 0.1
    assert coef.miss_ms == 2500.0
    coef.missed(10.0)
    now[0] += 0.2  # the 32 have aged out; one recent miss is too few to go by
    assert coef.miss_ms == 0.0 and over_slo(100.0 + coef.miss_ms, 0.0, 2000.0) == ""
    assert coef.gauges()["router_ttft_miss_ms"] == 0.0


def test_decode_admission_time_is_the_recent_median_or_the_oldest_wait_and_expires():
    now = [100.0]
    admit = StageLatency(clock=lambda: now[0])
    assert admit.estimate_ms() == 0.0
    tickets = [admit.start() for _ in range(3)]
    now[0] += 0.010
    admit.done(tickets[0])  # 10 ms
    now[0] += 0.020
    admit.done(tickets[1])  # 30 ms
    assert round(admit.estimate_ms(), 6) == 30.0  # median of 10 and 30 is 20; the third has waited 30
    admit.ended(tickets[2])  # it failed before admission: not a measurement
    admit.done(tickets[2])
    assert round(admit.estimate_ms(), 6) == 20.0
    late = admit.start()
    now[0] += 0.5
    assert round(admit.estimate_ms(), 6) == 500.0  # a request waiting longer than the recent ones took
    admit.done(late)
    assert round(admit.estimate_ms(), 6) == 30.0  # 10, 30, 500
    # Only admitted requests are timed: a high figure must not outlive its moment, or it would
    # refuse every request with nothing to lower it.
    now[0] += StageLatency.HORIZON_S + 0.001
    assert admit.estimate_ms() == 0.0
