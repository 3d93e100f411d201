"""`python -m pdserve.runtime.healthcheck HOST:PORT`: exit 0 when the server's gRPC health is SERVING (compose).

Health needs no credential; with the service's TLS files in its environment (PDSERVE_TLS_*) the
probe speaks TLS, presenting the service's own certificate."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.runtime import auth


def main() -> int:
    target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    try:
        tls = auth.current().channel_credentials()
        with grpc.secure_channel(target, tls) if tls else grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError as e:
        print(f"{target}: {e.code().name}", file=sys.stderr)
        return 1
    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
