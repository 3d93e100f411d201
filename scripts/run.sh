#!/usr/bin/env bash
# Sets up (idempotent) and runs the main job with the built-in `tiny` model: the whole stack
# (store, a prefill and a decode worker, the router; Redis at REDIS_URL or one of our own),
# then streams a first request. It keeps serving on 127.0.0.1:50050 until Ctrl-C.
# Extra flags go to `pdserve up` (e.g. --exit-after-demo, --prefill 2, --model PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve up --demo-prompt "${PROMPT:-The quick brown fox}" "$@"
