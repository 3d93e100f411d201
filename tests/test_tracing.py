"""One OpenTelemetry trace per request across all four services, caught by an in-test OTLP receiver."""

from __future__ import annotations

import time
import uuid
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.client import Client
from tests.support.stack import Stack


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes, dict]] = []  # (service, span name, trace id, attributes)
        self.kinds: dict[tuple[str, str], list[float]] = {}  # (service, span name) -> each one's duration, ms

    def Export(self, request, context):
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = {a.key: a.value for a in span.attributes}
                    self.spans.append((service, span.name, span.trace_id, attrs))
                    self.kinds.setdefault((service, span.name), []).append(
                        (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_one_trace_spans_router_prefill_store_decode(shared_redis_url):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}", env=env)
    try:
        s.start(1, 1)
        s.start_router(env=env)
        s.wait_pool(2)
        with Client(s.router.address) as c:
            result = c.generate(list(range(1, 100)), max_tokens=4, request_id="traced-1")
        assert result.usage["completion_tokens"] == 4
        # Each process exports on its own schedule: wait until every expected span is in.
        deadline = time.time() + 10
        while time.time() < deadline:
            routed = [sp for sp in receiver.spans if sp[1] == "route"]
            if routed:
                trace_id = routed[0][2]
                services = {sp[0] for sp in receiver.spans if sp[2] == trace_id}
                names = {sp[1] for sp in receiver.spans if sp[2] == trace_id}
                if services >= {"router", "prefill", "decode", "kvstore"} and names >= {
                        "route", "prefill", "store.put", "decode.pull", "/pdserve.v1.KVStore/AllocatePut",
                        "/pdserve.v1.KVStore/Watch", "/pdserve.v1.Decode/Generate"}:
                    break
            time.sleep(0.2)
        trace_id = next(sp[2] for sp in receiver.spans if sp[1] == "route")
        mine = [sp for sp in receiver.spans if sp[2] == trace_id]
        assert {sp[0] for sp in mine} >= {"router", "prefill", "decode", "kvstore"}
        names = {sp[1] for sp in mine}
        assert {"route", "prefill", "store.put", "decode.pull"} <= names
        assert any(sp[1] == "/pdserve.v1.KVStore/AllocatePut" for sp in mine)
        route = next(sp for sp in mine if sp[1] == "route")
        assert route[3]["request_id"].string_value == "traced-1" and route[3]["prompt_tokens"].int_value == 99
        # Streaming calls' spans end when their call does, not when a wrapper is collected.
        for key in (("router", "/pdserve.v1.Decode/Generate"), ("decode", "/pdserve.v1.KVStore/Watch")):
            assert key in receiver.kinds and max(receiver.kinds[key]) < result.timings["total_ms"] + 500, (
                key, receiver.kinds.get(key), result.timings)
        # Health checks (the router's, every refresh) are never traced.
        assert not [k for k in receiver.kinds if "grpc.health" in k[1]], sorted(receiver.kinds)
    finally:
        s.stop()
        server.stop(0)
