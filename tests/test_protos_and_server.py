"""Generated stubs are fresh; services report health and drain on SIGTERM."""

from __future__ import annotations

import filecmp
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.kvstore_support import start_store
from tests.support.procs import ROOT, SERVING, health


def test_checked_in_stubs_match_the_generator(tmp_path):
    subprocess.run([sys.executable, "scripts/gen_protos.py", "--out", str(tmp_path)], cwd=ROOT, check=True)
    fresh = tmp_path / "pdserve" / "v1"
    checked_in = ROOT / "pdserve" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == sorted(p.name for p in checked_in.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    stale = [n for n in names if not filecmp.cmp(fresh / n, checked_in / n, shallow=False)]
    assert stale == [], f"stale stubs {stale}: run scripts/gen_protos.py"
    assert len([n for n in names if n.endswith(".pyi")]) == 5


def test_health_serving_then_not_serving_on_sigterm(shared_redis_url, key_prefix):
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        assert health(store.address) == SERVING
        assert health(store.address, "pdserve.v1.KVStore") == SERVING
        seen: list[int] = []
        first = threading.Event()
        channel = grpc.insecure_channel(store.address)
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)

        def watch():
            try:
                for msg in stream:
                    seen.append(msg.status)
                    first.set()
            except grpc.RpcError:
                pass

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        assert first.wait(10)
        store.signal(signal.SIGTERM)
        assert store.proc.wait(15) == 0
        t.join(10)
        channel.close()
        assert seen == [SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
        assert '"shutting down"' in store.log() or "shutting down" in store.log()
    finally:
        store.stop()


def test_reflection_lists_services(shared_redis_url, key_prefix):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        with grpc.insecure_channel(store.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in resp.list_services_response.service}
        assert {"pdserve.v1.KVStore", "grpc.health.v1.Health"} <= names
    finally:
        store.stop()


def test_cpus_flag_pins_every_thread_of_the_process(shared_redis_url, key_prefix):
    """--cpus restricts the whole process, threads started before the flag was applied included."""
    import os

    import pytest

    from pdserve.runtime.service import parse_cpus, pin_cpus

    assert parse_cpus("0-2,5, 7") == {0, 1, 2, 5, 7} and parse_cpus("") == set()
    for bad in ("3-1", "x", "-1", "1-"):
        with pytest.raises(ValueError, match="not a CPU id or range"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="not available to this process"):
        pin_cpus("100000")
    cpu = max(os.sched_getaffinity(0))
    store = start_store(shared_redis_url, key_prefix, 4, 4, extra=("--cpus", str(cpu)))
    try:
        tids = os.listdir(f"/proc/{store.proc.pid}/task")
        assert len(tids) > 3  # gRPC's and the transfer engine's threads besides the main one
        allowed = {tid: os.sched_getaffinity(int(tid)) for tid in tids}
        assert set(map(frozenset, allowed.values())) == {frozenset({cpu})}
    finally:
        store.stop()
    out = subprocess.run([sys.executable, "-m", "services.kvstore", "--cpus", "2-1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "not a CPU id or range" in out.stderr


def test_bind_request_id_sets_what_every_log_line_of_the_context_carries():
    import contextvars

    import structlog

    from pdserve import logs

    def inside():
        structlog.contextvars.bind_contextvars(request_id="old")
        logs.bind_request_id("r-1")
        first = structlog.contextvars.merge_contextvars(None, "info", {})
        logs.bind_request_id("")
        return first, structlog.contextvars.merge_contextvars(None, "info", {})

    first, cleared = contextvars.copy_context().run(inside)
    assert first["request_id"] == "r-1" and cleared["request_id"] is None


def test_a_handler_cut_short_inside_the_service_answers_cancelled_not_silence():
    """A call the handler depends on is cancelled under it (its channel closed): the caller is told
    CANCELLED at once rather than waiting to its deadline. A caller's own cancel is not answered."""
    import asyncio
    import time

    from pdserve.runtime.server import ErrorInterceptor

    ended: list[str] = []

    class Health(health_pb2_grpc.HealthServicer):
        port = 0

        async def Watch(self, request, context):  # (a stream that waits until its caller goes)
            yield health_pb2.HealthCheckResponse(status=SERVING)
            try:
                await asyncio.get_running_loop().create_future()
            finally:
                ended.append("watch")

        async def Check(self, request, context):
            inner = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
            call = health_pb2_grpc.HealthStub(inner).Watch(health_pb2.HealthCheckRequest())
            await call.read()
            asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(inner.close()))
            await call.read()  # raises CancelledError when the channel closes: not the caller's doing
            return health_pb2.HealthCheckResponse(status=SERVING)

    async def scenario():
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        servicer = Health()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        servicer.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servicer.port}") as ch:
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return e.value.code(), e.value.details(), time.monotonic() - t0
        finally:
            await server.stop(0)

    code, details, seconds = asyncio.run(scenario())
    assert code == grpc.StatusCode.CANCELLED and "cut short" in details and seconds < 2.0
    assert ended == ["watch"]  # the inner stream's handler saw its caller go
