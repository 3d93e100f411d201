#!/usr/bin/env bash
# The CUDA path, checked on a GPU host in a few minutes, with no internet: only what the machine
# has and what this working tree carries. Writes one JSON file of results (default
# gpu_check.json; give another path as $1, or set OUT for $OUT/gpu_check.json).
#
#   1. torch sees CUDA (else it stops here, saying so)
#   2. the engine tests on cuda: device placement, tokens equal the CPU engine's, FlashAttention
#      against SDPA, logits against transformers on random small Llama and Qwen2 checkpoints
#   3. a one-node stack whose workers run on cuda (their KV staged through host memory): tokens
#      through prefill -> store -> decode, and through the router, equal the CPU engine's
#   4. pdserve bench engine --device cuda: prefill and batched decode tok/s at 512 and 4096
#      tokens, against transformers on the same GPU
#
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (to check the script itself, anywhere).
# Python: $PYTHON, else .venv/bin/python, else python3 (torch with CUDA, and the packages of
# `scripts/setup.sh --test`, must import there). Step 3 needs redis-server on the PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
result="${1:-${OUT:+$OUT/}gpu_check.json}"
PY="${PYTHON:-}"
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
export PDSERVE_TEST_DEVICE="$DEVICE" PDSERVE_DEVICE="$DEVICE" PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
logs="$(mktemp -d)"
steps=()

step() {  # step NAME TIMEOUT_S COMMAND...: runs it, keeps its rc, seconds and last lines
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS
    echo "== $name"
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    tail -n 5 "$logs/$name.log"
    steps+=("$name $rc $((SECONDS - t0))")
    return $rc
}

[ "$DEVICE" = cpu ] || step cuda_visible 60 "$PY" -c "
import torch, sys
print(torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')
sys.exit(0 if torch.cuda.is_available() else 1)" || cuda_missing=1

if [ -z "${cuda_missing:-}" ]; then
    step engine_tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_model_hf.py \
        tests/test_attention_seam.py::test_torch_and_kernel_backends_give_the_same_greedy_tokens
    if command -v redis-server >/dev/null; then
        # Workers take PDSERVE_DEVICE, and --kv-path auto (staged for GPU pages); the stack tests
        # stage host pages too.
        step stack_tokens 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_staged_stack.py \
            "tests/test_router_e2e.py::test_outputs_equal_the_local_engine_sync_async_streamed_unary"
    else
        steps+=("stack_tokens skipped:no-redis-server 0")
    fi
    step bench_engine 240 "$PY" -m pdserve.cli bench engine --device "$DEVICE" --prefill-lengths 512 4096 \
        --contexts 512 4096 --batches 1 16 --steps 16 --repeats 3 --json
fi

"$PY" - "$result" "$logs" "${steps[@]}" <<'PY'
import json, pathlib, sys
out, logs, steps = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
report = {"steps": []}
for line in steps:
    name, rc, seconds = line.split(" ")
    log = logs / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    entry = {"name": name, "rc": rc if not rc.lstrip("-").isdigit() else int(rc), "seconds": int(seconds),
             "tail": text.splitlines()[-15:]}
    if name == "bench_engine" and text:
        try:
            entry["figures"] = json.loads(text[text.index("{"):text.rindex("}") + 1])
        except ValueError:
            pass
    report["steps"].append(entry)
report["passed"] = all(s["rc"] == 0 for s in report["steps"] if isinstance(s["rc"], int))
pathlib.Path(out).write_text(json.dumps(report, indent=1))
print(f"gpu_check: {'passed' if report['passed'] else 'FAILED'}; results in {out}")
sys.exit(0 if report["passed"] else 1)
PY
