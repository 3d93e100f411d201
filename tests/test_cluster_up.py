"""`pdserve up --store-nodes 2 --cluster-store mooncake`: a mooncake_master, two store nodes and a
worker pair on each, one router. A prompt prefilled on one node, pushed out of that node's worker
and then its store by other prompts, is then served on the other node from the cluster tier (a
block reaches the cluster once no cache above it holds it): the reply's usage says
every full block came from the cluster, and the tokens are the same. Then the master is killed:
no request fails, and what only the cluster held is recomputed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT

BLOCK = 16


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 3 for i in range(blocks * BLOCK + 5)]


def _child(pid: int, name: str) -> int:
    """The pid of `pid`'s child process called `name` (one `pdserve up` started)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            comm, ppid = fields[0].partition("(")[2], int(fields[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and comm == name[:15]:
            return int(stat.parent.name)
    raise AssertionError(f"no child {name} of {pid}")


def test_a_prefix_computed_on_one_node_is_fetched_from_the_cluster_on_the_other(tmp_path):
    from pdserve.client import Client

    logs = tmp_path / "logs"
    # Each node's store: 16 device + 32 DRAM slots of 64 KiB (the tiny model's block); a worker's
    # cache 64 pages; a prompt is 20 full blocks.
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", "-1",
                           "--store-nodes", "2", "--cluster-store", "mooncake", "--cluster-segment-mib", "64",
                           "--prefill", "2", "--decode", "2", "--policy", "round_robin", "--num-blocks", "64",
                           "--store-device-mib", "1", "--store-dram-mib", "2", "--log-dir", str(logs),
                           "--key-prefix", f"pdtest-clup-{os.getpid()}"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    try:
        line = up.stdout.readline()
        assert line.startswith("router at "), line
        router = line.split()[-1]
        key = up.stdout.readline().strip().partition("=")[2]
        prompt = _prompt(1, 20)
        with Client(router, api_key=key, timeout_s=60) as c:
            first = c.generate(prompt, max_tokens=8, ignore_eos=True)
            assert first.usage["cached_tokens_cluster"] == 0
            home = first.route["prefill"]
            # Round robin alternates nodes; 12 other prompts push the first out of its worker's cache
            # (the third on its node), which hands it to its store, and out of that store (the fifth).
            fillers = [c.generate(_prompt(100 + i, 20), max_tokens=2, ignore_eos=True) for i in range(12)]
            assert {f.route["prefill"] for f in fillers} >= {home}
            again = [c.generate(prompt, max_tokens=8, ignore_eos=True) for _ in range(2)]
            away = [r for r in again if r.route["prefill"] != home]
            assert len(away) == 1, [r.route for r in again]
            r = away[0]
            assert r.token_ids == first.token_ids
            assert (r.usage["cached_tokens_local"], r.usage["cached_tokens_store"],
                    r.usage["cached_tokens_cluster"]) == (0, 20 * BLOCK, 20 * BLOCK), r.usage
            st = c.status()
            assert sorted(w.healthy for w in st.workers) == [True] * 4

            # The master killed: every request still succeeds; a prefix only the cluster held is
            # recomputed on the other node, to the same tokens.
            os.kill(_child(up.pid, "mooncake_master"), signal.SIGKILL)
            second = _prompt(2, 20)
            ref = c.generate(second, max_tokens=8, ignore_eos=True)
            for i in range(12):
                assert c.generate(_prompt(200 + i, 20), max_tokens=2, ignore_eos=True).usage["completion_tokens"] == 2
            again = [c.generate(second, max_tokens=8, ignore_eos=True) for _ in range(2)]
            away = [r for r in again if r.route["prefill"] != ref.route["prefill"]]
            assert len(away) == 1 and away[0].token_ids == ref.token_ids, [r.route for r in again]
            assert (away[0].usage["cached_tokens_cluster"], away[0].usage["computed_tokens"]) == (0, len(second))
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        names = sorted(p.name for p in logs.glob("*.log"))
        assert names == ["decode-0.log", "decode-1.log", "kvstore-0.log", "kvstore-1.log", "mooncake_master.log",
                         "prefill-0.log", "prefill-1.log", "router.log"]
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)
