"""The process wrapper shared by prefill and decode workers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from grpc_health.v1 import health_pb2

from pdserve import logs
from pdserve.engine.config import Role
from pdserve.runtime import bind_host, gc_tuning
from pdserve.runtime.server import build_server
from pdserve.runtime.service import parse_config, pin_cpus, run, write_port_file
from pdserve.worker.bootstrap import Worker, start_worker
from pdserve.worker.config import WorkerConfig

log = logs.get("worker")
EXIT_ENGINE_DEAD = 3  # the exit status of a worker whose engine stopped (distinct from a crash's 1)


def serve_worker(role: Role, make_servicer: Callable[[Worker], object], add_to_server: Callable,
                 service_name: str) -> None:
    """Run a worker process: engine + store + registry, one gRPC service, drain on SIGTERM."""

    async def main() -> None:
        cfg = parse_config(WorkerConfig, f"python -m services.{role.value}")
        bind_host.require(cfg.te_host)  # before anything else starts: it may re-execute the process
        pin_cpus(cfg.cpus)  # before the engine's, the transfer engine's and gRPC's threads start
        worker = await start_worker(cfg, role)
        servicer = make_servicer(worker)

        def register(server) -> list[str]:
            add_to_server(servicer, server)
            return [service_name]

        handle = await build_server(role.value, register, cfg.host, cfg.port, cfg.grace_s)
        stopped = handle.install_signal_handlers()
        registration = worker.registration(f"{cfg.advertise_host or cfg.host}:{handle.port}")
        registration.start()
        dead = asyncio.Event()
        worker.engine.on_death = lambda reason: dead.set()
        watchdog = asyncio.get_running_loop().create_task(_watch_steps(worker, cfg.step_timeout_s))
        gc_tuning.tune()  # the model and engine built: out of every collection from now on
        await handle.set_serving()
        write_port_file(cfg.port_file, handle.port)
        await asyncio.wait([asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(dead.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        watchdog.cancel()
        if dead.is_set():
            await _exit_dead(handle, registration, worker.engine.dead)
        try:
            await asyncio.wait_for(registration.stop(), timeout=2.0)  # deregister; Redis may be gone
        except TimeoutError:
            pass
        worker.engine.stop()

    run(role.value, main)


async def _watch_steps(worker: Worker, timeout_s: float) -> None:
    while True:
        await asyncio.sleep(min(1.0, timeout_s / 4))
        if (stuck := worker.engine.stuck_for()) > timeout_s:
            worker.engine.die(f"a step has run {stuck:.0f}s, past --step-timeout-s {timeout_s:g}")
            return


async def _exit_dead(handle, registration, reason: str) -> None:
    """The engine is gone: say NOT_SERVING, leave the registry, give the failed calls a moment
    to carry their statuses out, then exit non-zero so the supervisor starts a fresh worker."""
    log.error("worker exiting: its engine stopped", reason=reason)
    for name in ("", *handle.service_names):
        await handle.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        await asyncio.wait_for(registration.stop(), timeout=1.0)
    except Exception:  # noqa: BLE001 - Redis may be gone too; the heartbeat lapses on its own
        pass
    await asyncio.sleep(0.5)
    os._exit(EXIT_ENGINE_DEAD)
