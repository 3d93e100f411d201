"""A real Redis Cluster on loopback (three masters, or one), for the tests that run pdserve on one."""

from __future__ import annotations

import glob
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time

from pdserve.runtime.launch import RedisServer

BUS_OFFSET = 10_000  # a cluster node also listens on its port + 10000 (the cluster bus)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_ports(n: int) -> list[int]:
    """n ports whose bus ports (+10000) are free too, so below the ephemeral range's top."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randrange(20_000, 30_000)
        if p not in ports and _bindable(p) and _bindable(p + BUS_OFFSET):
            ports.append(p)
    return ports


class RedisCluster:
    """redis-server masters joined by `redis-cli --cluster create` (one master: given every slot,
    which `--cluster create` refuses to do); stopped by their pids."""

    def __init__(self, masters: int = 3) -> None:
        self.dir = tempfile.mkdtemp(prefix="pdserve-redis-cluster-")
        self.nodes = [RedisServer(port, config={"cluster-enabled": "yes", "dir": self.dir,
                                                "cluster-config-file": f"nodes-{port}.conf",
                                                "cluster-node-timeout": "2000"})
                      for port in _cluster_ports(masters)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def cli(self, *args: str, port: int | None = None, timeout_s: float = 30) -> str:
        return subprocess.run(["redis-cli", "-p", str(port or self.nodes[0].port), *args], capture_output=True,
                              text=True, timeout=timeout_s, check=True).stdout

    def start(self) -> RedisCluster:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed (scripts/setup.sh installs it)")
        for node in self.nodes:
            node.start()
        if len(self.nodes) == 1:
            self.cli("cluster", "addslotsrange", "0", "16383")
        else:
            self.cli("--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas",
                     "0", "--cluster-yes")
        deadline = time.time() + 30
        while not all("cluster_state:ok" in self.cli("cluster", "info", port=n.port) for n in self.nodes):
            if time.time() > deadline:
                raise RuntimeError("the redis cluster did not reach cluster_state:ok in 30 s")
            time.sleep(0.1)
        return self

    def masters_with_keys(self, pattern: str) -> set[int]:
        """The ports of the masters holding a key that matches `pattern`."""
        return {n.port for n in self.nodes if self.cli("--scan", "--pattern", pattern, port=n.port).strip()}

    def kill(self) -> None:
        """Every node killed at once (SIGKILL) and its cluster config removed: start() then brings
        up an empty cluster on the same ports."""
        for node in self.nodes:
            if node.proc is not None:
                node.proc.kill()
                node.proc.wait(10)
        for conf in glob.glob(os.path.join(self.dir, "nodes-*.conf")):
            os.remove(conf)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
