"""The engine on the built-in tiny model: batching, chunking, prefix cache, handoff, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.config import EngineConfig, Role
from pdserve.engine.engine import KVExport, LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import OutOfPagesError
from pdserve.engine.sequence import FinishReason
from pdserve.kv.hashing import block_hashes
from pdserve.model.attention import SeqPages
from pdserve.model.loader import load_model

B = 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 256 for i in range(n)]


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    return out


def alone(tiny, p: list[int], params=GREEDY) -> list[int]:
    return LLMEngine(tiny, EngineConfig(num_blocks=600)).generate([p], params)[0].token_ids


LENGTHS = [1, B - 1, B, B + 1, 3 * B + 5, 300]


@pytest.fixture(scope="module")
def reference(tiny):
    return {n: alone(tiny, prompt(n)) for n in LENGTHS}


@pytest.mark.parametrize("backend", ["kernel", "torch"])
def test_continuous_batching_with_joins_midway(tiny, reference, backend):
    """Both decode attention paths (C kernel in place, gathered pages + SDPA) give each sequence's
    tokens alone, while prompt chunks and decodes share steps."""
    engine = LLMEngine(tiny, EngineConfig(num_blocks=600, max_num_batched_tokens=64, attention_backend=backend))
    assert engine.runner.attention_backend.name == backend
    for n in LENGTHS[:3]:
        engine.add_request(f"r{n}", prompt(n), GREEDY)
    out: dict[str, list[int]] = {}
    for _ in range(4):
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    assert any(out.values()), "first wave should be decoding before the second joins"
    for n in LENGTHS[3:]:
        engine.add_request(f"r{n}", prompt(n), GREEDY)
    for rid, toks in run_all(engine).items():
        out.setdefault(rid, []).extend(toks)
    assert {rid: toks for rid, toks in out.items()} == {f"r{n}": reference[n] for n in LENGTHS}
    assert engine.scheduler.pool.num_used_blocks == 0


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_prefill_equals_one_shot(tiny, reference, chunk):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=600, max_num_batched_tokens=chunk))
    results = engine.generate([prompt(n) for n in LENGTHS], GREEDY)
    assert [r.token_ids for r in results] == [reference[n] for n in LENGTHS]


def test_prefix_cache_reuses_exact_blocks_and_frees_on_last_user(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64))
    pool = engine.scheduler.pool
    a = prompt(40)
    [ra] = engine.generate([a], SamplingParams(max_tokens=4, ignore_eos=True))
    assert pool.num_used_blocks == 0
    # 40 prompt + 3 computed output tokens -> two full blocks stay cached.
    hashes_a = block_hashes(a, engine.profile)
    cached = pool.match_prefix(hashes_a)
    assert len(cached) == 2

    b = a[:32] + prompt(10, salt=5)
    c = a[:32] + prompt(20, salt=9)
    engine.add_request("b", b, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("c", c, SamplingParams(max_tokens=8, ignore_eos=True))
    first = {ev.request_id: [ev.token_id] for ev in engine.step()}
    sb, sc = engine.scheduler.seqs["b"], engine.scheduler.seqs["c"]
    assert sb.block_table[:2] == cached and sc.block_table[:2] == cached
    assert sb.num_cached_tokens == sc.num_cached_tokens == 32
    assert [pool.ref_counts[x] for x in cached] == [2, 2]
    assert sb.num_computed_tokens == 42 and sc.num_computed_tokens == 52  # only the uncached rest
    out = {rid: first[rid] + toks for rid, toks in run_all(engine).items()}
    assert [pool.ref_counts[x] for x in cached] == [0, 0]
    assert pool.num_used_blocks == 0 and pool.match_prefix(hashes_a) == cached

    off = LLMEngine(tiny, EngineConfig(num_blocks=64, enable_prefix_caching=False))
    no_cache = off.generate([b, c], [SamplingParams(max_tokens=3, ignore_eos=True),
                                     SamplingParams(max_tokens=8, ignore_eos=True)])
    assert [r.token_ids for r in no_cache] == [out["b"], out["c"]]
    assert len(ra.token_ids) == 4
    assert off.scheduler.pool.num_cached_blocks == 0


def test_ref_counts_while_running_then_freed(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64))
    pool = engine.scheduler.pool
    p = prompt(48)
    engine.generate([p], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("x", p, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("y", p, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    x, y = engine.scheduler.seqs["x"], engine.scheduler.seqs["y"]
    # Full hit on 3 blocks: the last block is recomputed into a fresh page, the first two shared.
    assert x.num_cached_tokens == y.num_cached_tokens == 32
    shared = x.block_table[:2]
    assert y.block_table[:2] == shared and [pool.ref_counts[i] for i in shared] == [2, 2]
    while "y" in engine.scheduler.seqs:
        engine.step()
    assert [pool.ref_counts[i] for i in shared] == [1, 1]
    run_all(engine)
    assert [pool.ref_counts[i] for i in shared] == [0, 0] and pool.num_used_blocks == 0


def _prefill_export(tiny, p: list[int], params=GREEDY) -> KVExport:
    pe = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.PREFILL))
    pe.add_request("req", p, params)
    events = run_all(pe)
    assert len(events["req"]) == 1
    kv = pe.export_kv("req")
    assert pe.scheduler.pool.num_used_blocks == -(-len(p) // B)
    pe.release("req")
    assert pe.scheduler.pool.num_used_blocks == 0 and pe.scheduler.seqs == {}
    return kv


@pytest.mark.parametrize("n", [1, B - 1, B, B + 1, 3 * B + 5])
def test_export_import_continues_exactly(tiny, reference, n):
    kv = _prefill_export(tiny, prompt(n))
    assert kv.data.shape == (-(-n // B), 4, 2, 2, B, 64)
    assert kv.first_token == reference[n][0]
    de = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.DECODE))
    first = de.import_kv(kv, GREEDY)
    assert first.index == 0 and first.token_id == reference[n][0]
    assert [first.token_id] + run_all(de)["req"] == reference[n]
    assert de.scheduler.pool.num_used_blocks == 0


def test_import_reuses_local_prefix_blocks(tiny, reference):
    n = 3 * B + 5
    kv = _prefill_export(tiny, prompt(n))
    de = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.DECODE))
    de.import_kv(kv, GREEDY)
    first_pages = de.scheduler.seqs["req"].block_table[:3]
    run_all(de)
    reservation = de.reserve("again", kv.prompt_ids, GREEDY)
    assert reservation.num_cached_blocks == 3 and reservation.block_table[:3] == first_pages
    de.kv_cache.write_blocks(reservation.block_table[3:4], kv.data[3:])
    de.activate("again", kv.first_token, kv.first_logprob)
    assert de.scheduler.seqs["again"].block_table[:3] == first_pages
    assert run_all(de)["again"] == reference[n][1:]


def test_import_refuses_foreign_or_malformed_kv(tiny):
    kv = _prefill_export(tiny, prompt(20))
    de = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.DECODE))
    other = LLMEngine(tiny, EngineConfig(num_blocks=8, block_size=32))
    cases = {
        "model fingerprint differs": dataclasses.replace(
            kv, profile=dataclasses.replace(kv.profile, model_fingerprint="0" * 64)),
        "KV layout differs": dataclasses.replace(kv, profile=other.profile),
        "data shape": dataclasses.replace(kv, data=kv.data[:1]),
        "dtype": dataclasses.replace(kv, data=kv.data.to(torch.bfloat16)),
        "block hashes do not match": dataclasses.replace(kv, prompt_ids=tuple(prompt(20, salt=1))),
        "outside the vocabulary": dataclasses.replace(kv, first_token=10**6),  # (refused after its pages)
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            de.import_kv(bad, GREEDY)
        assert de.scheduler.pool.num_used_blocks == 0 and de.scheduler.seqs == {}
    de.import_kv(kv, GREEDY)
    assert len(run_all(de)["req"]) == GREEDY.max_tokens - 1


def test_decode_admission_refuses_when_pages_short(tiny):
    de = LLMEngine(tiny, EngineConfig(num_blocks=6, role=Role.DECODE))
    de.import_kv(_prefill_export(tiny, prompt(40)), SamplingParams(max_tokens=20), request_id="a")
    assert de.scheduler.pool.num_used_blocks == 4  # 40 + 20 - 1 slots
    with pytest.raises(OutOfPagesError, match="2 free KV pages, request needs 4"):
        de.import_kv(_prefill_export(tiny, prompt(40, salt=3)), SamplingParams(max_tokens=20), request_id="b")
    assert de.scheduler.pool.num_used_blocks == 4 and list(de.scheduler.seqs) == ["a"]
    assert len(run_all(de)["a"]) == 19 and de.scheduler.pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ([], GREEDY), "prompt is empty"),
        (lambda: (prompt(10), SamplingParams(max_tokens=32760)), "exceeds the context length"),
        (lambda: (prompt(3) + [258], GREEDY), "outside the vocabulary"),
        (lambda: (prompt(3) + [-1], GREEDY), "outside the vocabulary"),
        (lambda: (prompt(3), SamplingParams(max_tokens=0)), "max_tokens must be >= 1"),
        (lambda: (prompt(3), SamplingParams(temperature=-0.5)), "temperature must be a number in "),
        (lambda: (prompt(3), SamplingParams(top_p=0.0)), "top_p must be in"),
        (lambda: (prompt(3), SamplingParams(top_p=1.5)), "top_p must be in"),
        (lambda: (prompt(3), SamplingParams(top_k=-1)), "top_k must be >= 0"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(tiny, reference, make, message):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=600))
    engine.add_request("ok", prompt(B + 1), GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", *make())
    assert "bad" not in engine.scheduler.seqs
    assert run_all(engine)["ok"] == reference[B + 1][1:]


def test_too_big_for_the_cache_and_duplicate_ids(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=4))
    with pytest.raises(ValueError, match="needs 5 KV pages"):
        engine.add_request("big", prompt(70), SamplingParams(max_tokens=5))
    engine.add_request("a", prompt(5), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", prompt(5), GREEDY)


def test_decode_groups_bound_padding_and_mask_exactly(tiny):
    """Decoding sequences are grouped longest first; a group pads to its longest member only
    while padded pages stay within MAX_PADDING of real pages; padded slots are masked."""
    backend = LLMEngine(tiny, EngineConfig(num_blocks=64, attention_backend="torch")).runner.attention_backend
    bs = backend.block_size
    # (row, pages, context_len): 10, 9, 8 pages share a group (30 <= 1.25 * 27); the 2-page one
    # would make it 40 > 1.25 * 29, so it opens the next group with 2 and 1 (6 <= 1.25 * 5).
    decoding = [(0, list(range(0, 8)), 8 * bs - 3), (1, list(range(8, 10)), 2 * bs),
                (2, list(range(10, 20)), 9 * bs + 1), (3, [20], 5),
                (4, list(range(21, 30)), 9 * bs), (5, list(range(30, 32)), bs + 2)]
    long, short = backend.decode_groups([SeqPages(row, 1, ctx, pages) for row, pages, ctx in decoding])
    assert long.rows.tolist() == [2, 4, 0] and short.rows.tolist() == [1, 5, 3]
    assert long.kv_rows.numel() == 2 * 3 * 2 * 10 and short.kv_rows.numel() == 2 * 3 * 2 * 2
    assert long.valid.shape == (3, 1, 1, 10 * bs) and short.valid.shape == (3, 1, 1, 2 * bs)
    assert long.valid.view(3, -1).sum(1).tolist() == [9 * bs + 1, 9 * bs, 8 * bs - 3]
    assert short.valid.view(3, -1).sum(1).tolist() == [2 * bs, bs + 2, 5]
    # Row 3 (one page, 20) is padded with its own first page: K rows of page 20, layer 0.
    rows = short.kv_rows.view(2, 3, 2, 2)[0, 2, 0].tolist()
    stride = tiny.config.num_layers * 2 * tiny.config.num_kv_heads
    assert rows == [20 * stride, 20 * stride]


def test_sampling_seeded_is_reproducible_and_batch_independent(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=600))
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    one = engine.generate([prompt(20)], sp)[0]
    batch = engine.generate([prompt(33, 1), prompt(20), prompt(7, 2)], [GREEDY, sp, sp])
    assert batch[1].token_ids == one.token_ids
    other_seed = engine.generate([prompt(20)], SamplingParams(**{**sp.__dict__, "seed": 99}))[0]
    assert other_seed.token_ids != one.token_ids
    # top_k=1 sampling is greedy.
    k1 = engine.generate([prompt(20)], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=5,
                                                      ignore_eos=True))[0]
    assert k1.token_ids == alone(tiny, prompt(20))


def test_logprobs_are_log_softmax_of_the_chosen_token(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64))
    r = engine.generate([prompt(9)], SamplingParams(max_tokens=1))[0]
    from tests.test_model_hf import our_logits
    logits = our_logits(tiny, prompt(9))[-1]
    assert r.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[r.token_ids[0]].item(), abs=1e-5)


def test_stop_conditions(tiny, reference):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64))
    ref = reference[B]
    stop_at = ref[3]
    r = engine.generate([prompt(B)], SamplingParams(max_tokens=12, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert r.token_ids == ref[: ref.index(stop_at) + 1] and r.finish_reason == FinishReason.STOP
    r = engine.generate([prompt(B)], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert r.token_ids == ref[:5] and r.finish_reason == FinishReason.LENGTH
    eos = load_model("tiny").config.eos_token_ids[0]
    forced = engine.generate([prompt(B)], SamplingParams(max_tokens=12, stop_token_ids=(eos,)))[0]
    assert forced.token_ids[-1] == eos or forced.finish_reason == FinishReason.LENGTH


def test_abort_frees_pages(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=8))
    engine.add_request("a", prompt(40), GREEDY)
    engine.add_request("w", prompt(40, 1), GREEDY)
    engine.step()
    assert engine.abort("a") and engine.abort("w") and not engine.abort("nope")
    assert engine.scheduler.pool.num_used_blocks == 0 and not engine.has_work()


def test_mock_engine_is_deterministic_chunk_independent_and_handoff_exact(tiny):
    from pdserve.engine.mock_runner import CostModel

    cost = CostModel(step_ms=0.0, prefill_ms_per_token=0.0, prefill_ms_per_token_ctx=0.0, decode_ms_per_seq=0.0,
                     decode_ms_per_ctx_token=0.0)
    prompts = [prompt(n) for n in LENGTHS[:5]]
    one = LLMEngine(tiny, EngineConfig(num_blocks=600, mock_cost=cost)).generate(prompts, GREEDY)
    chunked = LLMEngine(tiny, EngineConfig(num_blocks=600, mock_cost=cost, max_num_batched_tokens=5)).generate(
        prompts, GREEDY)
    assert [r.token_ids for r in one] == [r.token_ids for r in chunked]
    assert one[0].token_ids != one[1].token_ids
    pe = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.PREFILL, mock_cost=cost))
    pe.add_request("m", prompts[4], GREEDY)
    run_all(pe)
    kv = pe.export_kv("m")
    assert kv.profile.model_fingerprint.startswith("mock-") and kv.data.abs().sum() > 0
    de = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.DECODE, mock_cost=cost))
    first = de.import_kv(kv, GREEDY)
    assert [first.token_id] + run_all(de)["m"] == one[4].token_ids
    with pytest.raises(ValueError, match="model fingerprint differs"):
        LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.DECODE)).import_kv(kv, GREEDY)
    # The cost model's step time: 2 prefill chunks and 1 decode.
    assert CostModel(1, 0.1, 0.0, 0.5, 0.01).step_time_ms(
        __import__("pdserve.engine.scheduler", fromlist=["SchedulerOutput"]).SchedulerOutput(())) == 1


def test_prefill_full_local_hit_copies_the_last_block_and_computes_one_token(tiny, reference):
    n = 3 * B
    p = prompt(n)
    pe = LLMEngine(tiny, EngineConfig(num_blocks=64, role=Role.PREFILL))
    pe.add_request("a", p, GREEDY)
    run_all(pe)
    first_pages = pe.scheduler.seqs["a"].block_table[:3]
    pe.release("a")
    r = pe.reserve("b", p, GREEDY)
    assert (r.num_cached_blocks, r.num_local_blocks) == (2, 3)
    assert r.block_table[:2] == first_pages[:2] and r.block_table[2] != first_pages[2]  # own copy of the last
    assert pe.kv_cache.tensor[r.block_table[2]].equal(pe.kv_cache.tensor[first_pages[2]])
    pe.start_compute("b", 3)
    seq = pe.scheduler.seqs["b"]
    assert seq.num_computed_tokens == n - 1  # only the last token is computed
    assert run_all(pe)["b"] == [reference.get(n, alone(tiny, p))[0]]


def test_linear_weights_move_once_into_one_huge_page_buffer(reference):
    fresh = load_model("tiny")
    linears = [m for m in fresh.model.modules() if isinstance(m, torch.nn.Linear)]
    before = [m.weight.detach().clone() for m in linears]
    assert len({m.weight.untyped_storage().data_ptr() for m in linears}) == len(linears)
    engine = LLMEngine(fresh, EngineConfig(num_blocks=600))
    storages = {m.weight.untyped_storage().data_ptr() for m in linears}
    assert len(storages) == 1
    assert linears[0].weight.data_ptr() % (2 << 20) == 0
    assert all(torch.equal(m.weight, w) for m, w in zip(linears, before, strict=True))
    where = [m.weight.data_ptr() for m in linears]
    LLMEngine(fresh, EngineConfig(num_blocks=600))  # a second engine on the same model moves nothing
    assert [m.weight.data_ptr() for m in linears] == where
    p = prompt(3 * B + 5)
    assert engine.generate([p], GREEDY)[0].token_ids == reference[len(p)]

