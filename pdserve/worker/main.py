"""The process wrapper shared by prefill and decode workers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.engine.config import Role
from pdserve.runtime.server import build_server
from pdserve.runtime.service import parse_config, pin_cpus, run, write_port_file
from pdserve.worker.bootstrap import Worker, start_worker
from pdserve.worker.config import WorkerConfig


def serve_worker(role: Role, make_servicer: Callable[[Worker], object], add_to_server: Callable,
                 service_name: str) -> None:
    """Run a worker process: engine + store + registry, one gRPC service, drain on SIGTERM."""

    async def main() -> None:
        cfg = parse_config(WorkerConfig, f"python -m services.{role.value}")
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
        await handle.set_serving()
        write_port_file(cfg.port_file, handle.port)
        await stopped.wait()
        try:
            await asyncio.wait_for(registration.stop(), timeout=2.0)  # deregister; Redis may be gone
        except TimeoutError:
            pass
        worker.engine.stop()

    run(role.value, main)
