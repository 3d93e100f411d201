"""Start pdserve service processes and know when they serve (used by `pdserve up`, benches, tests)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pdserve.native import NativeUnavailable
from pdserve.runtime import bind_host

ROOT = Path(__file__).resolve().parents[2]  # the repository (services run from it with -m)


def die_with_parent() -> list[str]:
    """A command prefix under which the child gets SIGTERM when the thread that started it dies,
    however it dies (even SIGKILL), so no service outlives its launcher.

    util-linux's `setpriv` sets the death signal and execs the command. (A preexec_fn would run
    Python in the forked child, which crashes now and then when other threads of the parent are
    inside gRPC.) Without setpriv the launcher's own cleanup still stops its children."""
    exe = shutil.which("setpriv")
    return [exe, "--pdeathsig", "TERM", "--"] if exe else []


def _preload() -> dict[str, str]:
    """The bind interposer preloaded (runtime.bind_host), so a service need not re-execute itself
    to get it; where it cannot be built, the service says why when it starts."""
    try:
        return bind_host.preload_env()
    except NativeUnavailable:
        return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_reachable(url: str = "redis://127.0.0.1:6379/0") -> bool:
    """Whether a Redis answers at `url` (one that wants a password counts: it answered). A
    rediss:// URL is probed over TLS, unverified: this asks only whether something is there."""
    import ssl
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=0.5) as raw:
            if u.scheme == "rediss":
                ctx = ssl.create_default_context()
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
                s = ctx.wrap_socket(raw, server_hostname=u.hostname)
            else:
                s = raw
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """A redis-server of our own on a free port; stopped by its pid, never anyone else's."""

    def __init__(self, port: int | None = None, password: str = "", config: dict[str, str] | None = None) -> None:
        """`password`: require it (AUTH); given on redis-server's stdin, never on its command line.
        `config`: more redis.conf directives (e.g. a cluster node's)."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
        self.exe = exe
        self.port = port or free_port()
        self.password = password
        self.config = config or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10) -> RedisServer:
        """Returns once it answers; raises, with the child ended, if it does not within `timeout_s`."""
        # redis-server reads a config from stdin when given "-" (so `ps` never shows the password).
        config = "".join(f"{k} {v}\n" for k, v in (("port", self.port), ("bind", "127.0.0.1"), ("save", '""'),
                                                   ("appendonly", "no"), *self.config.items()))
        if self.password:
            config += f"requirepass {self.password}\n"
        self.proc = subprocess.Popen(
            [*die_with_parent(), self.exe, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        with _ended_on_failure(self.proc):
            self.proc.stdin.write(config.encode())
            self.proc.stdin.close()
            _wait_until(self.proc, lambda: redis_reachable(self.url), timeout_s, f"redis-server on port {self.port}")
        return self

    def stop(self, timeout_s: float = 10) -> None:
        _end(self.proc, timeout_s)


class ServiceProcess:
    """`python -m <module>` with flags; its port is known once the service is serving."""

    def __init__(self, module: str, *flags: str, env: dict[str, str] | None = None, name: str | None = None,
                 log_dir: str | None = None):
        """`log_dir`: keep the log there as `<name>.log` after stop (else it goes with the process)."""
        self.name = name or module.rsplit(".", 1)[-1]
        self.tmp = tempfile.mkdtemp(prefix=f"pdserve-{self.name}-")
        self.port_file = os.path.join(self.tmp, "port")
        self.log_path = os.path.join(log_dir or self.tmp, f"{self.name}.log" if log_dir else "log")
        self.args = [*die_with_parent(), sys.executable, "-m", module, "--port-file", self.port_file, *flags]
        self.env = {**os.environ, **_preload(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def spawn(self) -> ServiceProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 120) -> ServiceProcess:
        deadline = time.time() + timeout_s
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.time() > deadline:
                raise RuntimeError(f"{self.name} did not become ready in {timeout_s}s:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        self.port = int(Path(self.port_file).read_text())
        return self

    def start(self, timeout_s: float = 120) -> ServiceProcess:
        return self.spawn().wait_ready(timeout_s)

    def log(self) -> str:
        return Path(self.log_path).read_text() if os.path.exists(self.log_path) else ""

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log:
            self._log.close()
            self._log = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def mooncake_master_exe() -> str:
    """The `mooncake_master` the transfer-engine wheel ships (beside this interpreter, or on PATH)."""
    beside = Path(sys.executable).with_name("mooncake_master")
    exe = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if exe is None:
        raise RuntimeError("mooncake_master not found: it comes with the mooncake-transfer-engine wheel")
    return exe


class MooncakeMaster:
    """A mooncake_master of our own (the cluster tier's metadata and placement service) on a
    free port, bound to `host`; stopped by its pid, never anyone else's. It keeps object
    metadata in memory only: a restarted master starts empty."""

    # How long an object stays unevictable after a put or a get (Mooncake's default: 10 s). The
    # cluster tier is a cache: at 10 s a busy cluster is full of objects it may not evict, and
    # refuses the newest blocks while it keeps old ones. 1 s covers a fetch; a read that outlives
    # its lease and finds the memory reused by another key's object is refused (its trailer names
    # another block) and is a miss, never wrong KV.
    KV_LEASE_MS = 1000

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_path: str | None = None) -> None:
        self.exe = mooncake_master_exe()
        self.host = host
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 20) -> MooncakeMaster:
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*die_with_parent(), self.exe, f"--rpc_port={self.port}", f"--rpc_address={self.host}",
             f"--metrics_host={self.host}", f"--metrics_port={free_port()}",
             "--enable_http_metadata_server=false", f"--default_kv_lease_ttl={self.KV_LEASE_MS}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with _ended_on_failure(self.proc):
            _wait_until(self.proc, lambda: _accepts(self.host, self.port), timeout_s,
                        f"mooncake_master on {self.address}")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10) -> None:
        _end(self.proc, timeout_s)


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _wait_until(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not ready():
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)


@contextlib.contextmanager
def _ended_on_failure(proc: subprocess.Popen) -> Iterator[None]:
    """Whatever interrupts a start (a timeout, a signal's exception) ends our child first: a
    caller whose start() raised may hold no handle to it."""
    try:
        yield
    except BaseException:
        _end(proc, 10)
        raise


def _end(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM to our child `proc`, SIGKILL if it has not gone within `timeout_s`; reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
