"""The launchers of a Redis and a mooncake_master leave no child behind: one that does not answer
in time is ended before start() raises, and one that ignores SIGTERM is killed by stop()."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time

import pytest

from pdserve.runtime.launch import MooncakeMaster, RedisServer, free_port


def _gone(proc) -> bool:
    return proc.poll() is not None


def test_a_redis_server_that_never_answers_is_ended():
    # It listens, but on another port than the one the launcher waits on.
    server = RedisServer(password=secrets.token_urlsafe(24), config={"port": str(free_port())})
    try:
        with pytest.raises(RuntimeError, match="redis-server on port .* did not start"):
            server.start(timeout_s=1)
        assert _gone(server.proc)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def test_stop_kills_a_redis_server_that_ignores_sigterm():
    server = RedisServer(password=secrets.token_urlsafe(24)).start()
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)  # (a stopped process leaves SIGTERM pending)
        t0 = time.monotonic()
        server.stop(timeout_s=1)
        assert _gone(server.proc) and server.proc.returncode == -signal.SIGKILL
        assert time.monotonic() - t0 < 5
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def test_a_mooncake_master_that_never_answers_is_ended(monkeypatch):
    master = MooncakeMaster()

    def refuse(*_args, **_kwargs):
        raise ConnectionRefusedError("(the test's)")

    monkeypatch.setattr(socket, "create_connection", refuse)
    try:
        with pytest.raises(RuntimeError, match="mooncake_master on .* did not start"):
            master.start(timeout_s=1)
        assert _gone(master.proc)
    finally:
        master.kill()
