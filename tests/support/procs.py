"""Real processes for tests: a private redis-server, service processes, and their health."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_reachable(host: str = "127.0.0.1", port: int = 6379) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server of our own on a free port; stopped by its pid, never anyone else's."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed: run scripts/setup.sh")
        self.exe = exe
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while not redis_reachable(port=self.port):
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("private redis-server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class ServiceProcess:
    """`python -m services.<name>` with flags; knows its port once the service is serving."""

    def __init__(self, module: str, *flags: str, env: dict[str, str] | None = None):
        self.tmp = tempfile.mkdtemp(prefix="pdserve-test-")
        self.port_file = os.path.join(self.tmp, "port")
        self.log_path = os.path.join(self.tmp, "log")
        self.args = [sys.executable, "-m", module, "--port-file", self.port_file, *flags]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> ServiceProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[2]} exited with {self.proc.returncode}:\n{self.log()}")
            if time.time() > deadline:
                raise RuntimeError(f"{self.args[2]} did not become ready:\n{self.log()}")
            time.sleep(0.05)
        self.port = int(Path(self.port_file).read_text())
        return self

    def log(self) -> str:
        return Path(self.log_path).read_text() if os.path.exists(self.log_path) else ""

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def health(address: str, service: str = "") -> int:
    """The health status as an int (health_pb2.HealthCheckResponse.SERVING == 1)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
