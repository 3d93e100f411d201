#!/usr/bin/env bash
# Sets up (idempotent) and runs the main job with the built-in `tiny` model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve generate --local --model tiny --prompt "${PROMPT:-The quick brown fox}" --max-tokens 48 "$@"
