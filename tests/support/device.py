"""The device the engine tests run on: `cpu` here, `cuda` when scripts/gpu_check.sh sets
PDSERVE_TEST_DEVICE on a GPU host."""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
