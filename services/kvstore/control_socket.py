"""The store's control socket: the control calls (allocate, commit, get, renew, release) as
ControlRequest/ControlResponse frames (pdserve/kv/control_frames.py) on one TCP connection per
client, or one Unix-socket connection for a client on the store's host.

Why beside gRPC: measured on this project's 2-vCPU hosts, a message on an open grpc.aio stream
takes a round trip of 0.5-0.8 ms once the process has idled a few ms (as it has during a
transfer), the same message on an asyncio connection 0.2-0.35 ms; a put makes two control calls
around a transfer of a few ms, so that difference is most of its overhead. Everything else
(Info, Watch, Stats, the bytes path, health, reflection) is gRPC, and the unary RPCs serve the
same calls to gRPC-only clients.

On Linux the store also listens on a Unix socket in the abstract namespace (no file; reachable
from the store's network namespace only, so a client in another container falls back to TCP):
measured here, a cold round trip between two asyncio processes took 95-200 µs on it against
140-230 µs on TCP loopback.

Calls are served as their frames arrive, synchronously on the event loop (the store is
single-threaded, its control calls never wait), so a connection's answers come in order. Each
answer is sent before the call's deferred bookkeeping runs (services/kvstore/deferred.py), and
that runs before the next frame is served. A frame that cannot be read has no call id to
answer: the connection ends, the store goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from google.protobuf.message import DecodeError

from pdserve import logs
from pdserve.kv.control_frames import FrameError, FrameReader, frame
from pdserve.v1 import kvstore_pb2 as pb
from services.kvstore.deferred import Deferred

log = logs.get("kvstore.control")

Serve = Callable[[pb.ControlRequest], pb.ControlResponse]


class _Connection(asyncio.Protocol):
    def __init__(self, serve: Serve, deferred: Deferred, open_connections: set[_Connection]):
        self._serve = serve
        self._deferred = deferred
        self._open = open_connections
        self._frames = FrameReader()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._open.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            requests = [pb.ControlRequest.FromString(p) for p in self._frames.feed(data)]
        except (FrameError, DecodeError) as e:
            log.warning("control connection closed: unreadable frame", peer=self._peer(), error=str(e))
            self.transport.close()
            return
        for request in requests:
            self._deferred.hold()
            try:
                self.transport.write(frame(self._serve(request)))
            finally:
                self._deferred.run()

    # A client that stops reading its answers stops being read (its writes back up in its own
    # socket), so the store never buffers without bound for it.
    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.discard(self)

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unix" if peer == "" else "?"


class ControlSocket:
    """Owns the listening socket and the open connections. `deferred`: the store's, held
    while a call is served and run once its answer is sent."""

    def __init__(self, serve: Serve, deferred: Deferred):
        self._serve = serve
        self._deferred = deferred
        self._servers: list[asyncio.Server] = []
        self._open: set[_Connection] = set()

    async def start(self, host: str, port: int, unix_name: str = "") -> int:
        """Listen on TCP, and on the abstract Unix socket `unix_name` too if one is given
        (without its leading NUL); returns the bound TCP port (port 0: any free one)."""
        loop = asyncio.get_running_loop()

        def connection() -> _Connection:
            return _Connection(self._serve, self._deferred, self._open)

        self._servers.append(await loop.create_server(connection, host, port))
        if unix_name:
            self._servers.append(await loop.create_unix_server(connection, "\0" + unix_name))
        return self._servers[0].sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end every connection (after the gRPC drain: a writer in the grace
        period still commits through here)."""
        for server in self._servers:
            server.close()
        for conn in list(self._open):
            conn.transport.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
