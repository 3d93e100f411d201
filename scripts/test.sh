#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite: lint, the import rules, then pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
.venv/bin/ruff check . || exit 1
.venv/bin/lint-imports --no-cache || exit 1  # the import rules (pyproject.toml [tool.importlinter])
# Two pytest workers, a test file each at a time (pytest-xdist): most tests wait on processes they
# started, so one worker leaves a 2-core machine half idle. PDSERVE_TEST_WORKERS=0 runs them in one.
.venv/bin/python -m pytest -q -n "${PDSERVE_TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
