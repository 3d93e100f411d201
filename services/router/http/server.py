"""The HTTP API's server: uvicorn on the router's own event loop, on a socket bound here (so
port 0 works and the port is known), stopped by the router's own signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from pdserve.runtime import auth

STOP_S = 3.0  # open streams are given this long to finish on stop


class _Server(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # the router's handlers own SIGTERM/SIGINT


class HttpServer:
    """Owns the listening socket and uvicorn's serving task."""

    def __init__(self, app, host: str, port: int, tls: auth.TlsFiles | None = None):
        """tls: the router's certificate (--tls-cert, --tls-key): HTTPS, as its gRPC port serves TLS,
        so no API key crosses the network in clear."""
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                         reuse_port=False)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=STOP_S, server_header=False,
                                ssl_certfile=tls.cert_path if tls else None, ssl_keyfile=tls.key_path if tls else None)
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # (raises why it could not start)
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, STOP_S + 1.0)
        except TimeoutError:
            self.task.cancel()
        self.sock.close()
