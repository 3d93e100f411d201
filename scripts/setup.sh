#!/usr/bin/env bash
# Idempotent setup from a clean clone: Debian packages the project needs, a venv in .venv,
# torch (the CPU build when none is installed), and pdserve itself.
#   bash scripts/setup.sh           runtime only
#   bash scripts/setup.sh --test    with the test extras (pytest, transformers, grpcio-tools, ruff)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "setup: need root (or sudo) to run: $*" >&2; exit 1; fi; }

apt_missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || apt_missing+=(libibverbs1)  # Mooncake Transfer Engine
command -v redis-server >/dev/null || apt_missing+=(redis-server)  # tests and `pdserve up` start their own
command -v redis-cli >/dev/null || apt_missing+=(redis-tools)  # the Redis Cluster test joins its nodes with it
command -v setpriv >/dev/null || apt_missing+=(util-linux)  # children die with their launcher (pdserve.runtime.launch)
# The CPU kernels (decode attention, norms) are C, built on first use: a compiler and libc headers.
{ command -v cc || command -v gcc; } >/dev/null || apt_missing+=(gcc)
[ -e /usr/include/math.h ] || apt_missing+=(libc6-dev)
command -v python3 >/dev/null || apt_missing+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || apt_missing+=(python3-venv)
# The tests check compose.yaml with `docker-compose config` (no Docker engine needed for that).
[ -n "$extras" ] && ! command -v docker-compose >/dev/null && apt_missing+=(docker-compose)
if [ ${#apt_missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${apt_missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${apt_missing[@]}" >/dev/null
fi

python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "setup: pdserve needs Python >= 3.11, found $(python3 --version)" >&2; exit 1; }
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python

stamp=".venv/.pdserve-setup-$(cat pyproject.toml | sha256sum | cut -c1-16)${extras:+-test}"
if [ -f "$stamp" ] && $py -c 'import pdserve, torch' 2>/dev/null; then
  exit 0
fi
$py -m pip install -q --upgrade pip
# A bare `torch` requirement would pull a multi-GB CUDA build; take the CPU build unless one is present.
$py -c 'import torch' 2>/dev/null || $py -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
$py -m pip install -q -e ".${extras}"
touch "$stamp"
echo "setup: ready (.venv)"
