"""The command-line contract: `pdserve generate --local`, `pdserve bench engine --json` and `bench kvstore --json`."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=600)


def test_generate_local_json_matches_engine(tiny):
    out = pdserve("generate", "--local", "--prompt", "Hello pdserve", "--max-tokens", "9", "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    prompt_ids = tiny.tokenizer.encode("Hello pdserve")
    expected = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate(
        [prompt_ids], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    assert doc["token_ids"] == expected.token_ids
    assert doc["prompt_tokens"] == len(prompt_ids) == 13
    assert doc["text"] == tiny.tokenizer.decode(expected.token_ids)
    assert doc["finish_reason"] == "length" and doc["ttft_ms"] > 0


def test_generate_local_streams_text(tiny):
    out = pdserve("generate", "--local", "--prompt", "abc", "--max-tokens", "5", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    expected = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate(
        [tiny.tokenizer.encode("abc")], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.stdout == tiny.tokenizer.decode(expected.token_ids) + "\n"


def test_generate_local_bad_input_is_a_clear_error():
    out = pdserve("generate", "--local", "--prompt", "", "--max-tokens", "5")
    assert out.returncode == 2 and "prompt is empty" in out.stderr
    out = pdserve("generate", "--local", "--prompt", "x", "--top-p", "2")
    assert out.returncode == 2 and "top_p must be in (0, 1]" in out.stderr
    out = pdserve("bench", "engine", "--model", "/nonexistent/model", "--peer", "off")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr == ("pdserve: error: model directory not found: /nonexistent/model "
                          "(or use the built-in model 'tiny')\n")


def test_bench_engine_json_format():
    out = pdserve("bench", "engine", "--json", "--prefill-lengths", "32", "--contexts", "32",
                  "--batches", "1", "16", "--steps", "2", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [p["prompt_tokens"] for p in doc["prefill"]] == [32]
    assert [(d["batch"], d["context"]) for d in doc["decode"]] == [(1, 32), (16, 32)]
    names = [t["name"] for t in doc["targets"]]
    # A transformers decode too short to time (2 steps: its two generate() calls' difference can
    # be <= 0) is left out with its ratio and target, never invented.
    assert names[-1] == "prefill_vs_transformers_min"
    assert names[:-1] == (["decode_batch16_vs_transformers_min"] if "ratio" in doc["decode"][1] else [])
    assert all(("ratio" in d) == ("transformers_tok_s" in d) for d in doc["decode"])
    # No llama.cpp column for tiny (no files to convert), or without the peer extra: said so, no figure.
    assert set(doc["llama_cpp"]) == {"skipped"} and not any("llama_cpp" in r for r in doc["decode"])
    for t in doc["targets"]:
        assert set(t) == {"name", "value", "unit", "target", "comparison", "met"}
        assert t["met"] == (t["value"] >= t["target"])


def test_bench_kvstore_json_format(shared_redis_url):
    out = pdserve("bench", "kvstore", "--json", "--layouts", "tiny", "7b", "--tokens", "64", "1024", "--repeats", "1",
                  "--redis-url", shared_redis_url)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(r["layout"], r["tokens"], r["blocks"]) for r in doc["rows"]] == [
        ("tiny", 64, 4), ("tiny", 1024, 64), ("7b", 64, 4), ("7b", 1024, 64)]
    assert all(r["checksum_gbps"] > 0 and 0 < r["checksum_serial_share_of_put"] for r in doc["rows"])
    assert all("checksum_cost_of_put" in r and "checksum_cost_of_get" in r for r in doc["rows"])
    assert [(r["tokens"], r["blocks"]) for r in doc["full_store_tiny"]] == [(64, 4), (1024, 64)]
    assert all(r["raw_write_gbps"] > 0 and r["raw_polled_read_gbps"] > 0 for r in doc["rows"])
    assert all(r["allocate_p50_ms"] > 0 for r in doc["full_store_tiny"])
    assert [t["name"] for t in doc["targets"]] == [  # (the 7B-shaped rows' only: tiny rows are reported)
        "store_put_vs_raw_7b_min_ge1024", "store_get_vs_raw_7b_min_ge1024", "checksum_cost_of_put_7b_max",
        "checksum_cost_of_get_7b_max"]
    for t in doc["targets"]:
        assert set(t) == {"name", "value", "unit", "target", "comparison", "met"}
        assert t["met"] == (t["value"] >= t["target"] if t["comparison"] == ">=" else t["value"] <= t["target"])


def test_a_bench_process_logs_to_stderr_never_into_its_json_on_stdout():
    """A slow collection's warning in the bench's load generator once landed in the middle of
    `bench serve --json`'s stdout."""
    code = ("from pdserve import cli, logs\n"
            "from pdserve.runtime import gc_tuning\n"
            "cli.prepare_bench()\n"
            "watch = gc_tuning.PauseWatch(0.0)\n"
            "watch('start', {})\n"
            "watch('stop', {'generation': 2, 'collected': 1})\n"
            "logs.get('x').warning('a warning')\n"
            "logs.get('x').info('not shown')\n"
            "print('{}')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "{}\n"
    assert '"event": "slow garbage collection"' in done.stderr and '"event": "a warning"' in done.stderr
    assert "not shown" not in done.stderr
