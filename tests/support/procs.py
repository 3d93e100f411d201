"""Real processes for tests (the launcher is pdserve's own) and health checks."""

from __future__ import annotations

import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.runtime.launch import ROOT, RedisServer, ServiceProcess, free_port, redis_reachable

__all__ = ["ROOT", "RedisServer", "ServiceProcess", "free_port", "redis_reachable", "health", "SERVING",
           "NOT_SERVING", "listening"]


def health(address: str, service: str = "") -> int:
    """The health status as an int (health_pb2.HealthCheckResponse.SERVING == 1)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket the process listens on, from /proc (an IPv4-mapped
    IPv6 address as its IPv4 address)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    found.add((_address(addr, width), int(port, 16)))
    return found


def _address(hexaddr: str, width: int) -> str:
    if width == 32 and hexaddr.startswith("0000000000000000FFFF0000"):
        hexaddr, width = hexaddr[24:], 8
    if width == 8:
        return ".".join(str(b) for b in reversed(bytes.fromhex(hexaddr)))
    return "::" if set(hexaddr) == {"0"} else hexaddr
