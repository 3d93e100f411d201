"""Real processes for tests (the launcher is pdserve's own) and health checks."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.runtime.launch import ROOT, RedisServer, ServiceProcess, free_port, redis_reachable

__all__ = ["ROOT", "RedisServer", "ServiceProcess", "free_port", "redis_reachable", "health", "SERVING",
           "NOT_SERVING"]


def health(address: str, service: str = "") -> int:
    """The health status as an int (health_pb2.HealthCheckResponse.SERVING == 1)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
