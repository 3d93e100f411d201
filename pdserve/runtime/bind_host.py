"""The transfer engine's listening ports on the configured host, not on every address.

Mooncake's transfer engine (0.3.13) binds its handshake port and its data port to every address,
and nothing in its API or environment changes that. So each service process runs with a small
`bind()` interposer preloaded (csrc/bind_host.c): a wildcard bind made by a thread inside
`confined(host)` lands on `host` instead (an IPv6 socket on the IPv4-mapped form); every other bind
passes through, so gRPC still listens where `--host` says. The engine binds both ports on the
thread that initializes it.

Launchers (`ServiceProcess`) start services with `preload_env()`; a service started any other way
re-executes itself with it (`require`), before its transfer engine starts. A process that is not a
service (a bench client, the tests) has no interposer: its engine listens on every address.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pdserve import native

SOURCE = Path(__file__).with_name("csrc") / "bind_host.c"
WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")
_REEXEC = "PDSERVE_BIND_REEXEC"  # set across the one re-exec `require` makes: never a second


@functools.cache
def library() -> Path:
    """The interposer, built for this machine on first use (looked up once a process: every
    ServiceProcess asks)."""
    return native.shared_object("bind_host", [SOURCE], ["-O2", "-fPIC"], ["-shared", "-ldl"])


def preload_env(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The LD_PRELOAD under which a child process has the interposer (any preload kept)."""
    lib = str(library())
    current = environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": current if lib in current.split() else f"{lib} {current}".strip()}


def _narrow() -> Callable[[bytes], int] | None:
    """The interposer's switch, when this process was started with it preloaded."""
    fn = getattr(ctypes.CDLL(None), "pdserve_bind_narrow", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_char_p], ctypes.c_int
    return fn


def require(host: str) -> None:
    """Make sure this process can confine its transfer engine to `host`: re-execute it (same
    pid, argv and environment, plus the preload) when it was started without the interposer.
    Exits with the reason when the interposer cannot be built or loaded."""
    if host in WILDCARDS or _narrow() is not None:
        return
    if os.environ.get(_REEXEC):
        raise SystemExit(f"cannot confine the transfer engine to {host}: LD_PRELOAD was not honoured "
                         "(a set-user-ID interpreter?); --te-host 0.0.0.0 listens on every address")
    try:
        env = {**os.environ, **preload_env(), _REEXEC: "1"}
    except native.NativeUnavailable as e:
        raise SystemExit(f"cannot confine the transfer engine to {host}: {e}; "
                         "--te-host 0.0.0.0 listens on every address") from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def numeric(host: str) -> str:
    """`host` as an address (a name resolved, IPv4 first: the engine's peers dial IPv4)."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host.strip("[]")))
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


@contextlib.contextmanager
def confined(host: str) -> Iterator[None]:
    """Within it, this thread's wildcard binds land on `host` (in a process started with the
    interposer: every service, see `require`)."""
    narrow = _narrow()
    if host in WILDCARDS or narrow is None:
        yield
        return
    address = numeric(host)
    if narrow(address.encode()) != 0:
        raise ValueError(f"cannot confine binds to {host!r} ({address!r} is not an address)")
    try:
        yield
    finally:
        narrow(b"")
