"""The SDK's own checks of its arguments: clear pdserve errors before anything is sent (no
server: a call that got past them would fail UNAVAILABLE instead)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from pdserve import errors
from pdserve.client import AsyncClient, Client
from tests.support.procs import ROOT


def test_pdserve_errors_is_there_on_import():
    out = subprocess.run([sys.executable, "-c", "import pdserve; print(pdserve.errors.InvalidArgument.__name__)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "InvalidArgument", out.stderr


@pytest.mark.parametrize("kw,message", [
    ({"max_tokens": -1}, "max_tokens must be an integer in [1, 4294967295], got -1"),
    ({"max_tokens": 0}, "max_tokens must be an integer in [1,"),
    ({"top_k": -3}, "top_k must be an integer in [0,"),
    ({"seed": -7}, "seed must be an integer in [0, 18446744073709551615], got -7"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[] must be an integer in [0,"),
])
def test_bad_sampling_arguments_are_invalid_argument(kw, message):
    with Client("127.0.0.1:1", timeout_s=1) as c:
        with pytest.raises(errors.InvalidArgument) as e:
            c.generate("x", **kw)
        assert message in str(e.value)
        with pytest.raises(errors.InvalidArgument):
            list(c.stream("x", **kw))
        with pytest.raises(errors.InvalidArgument, match="prompt must be a string or a list"):
            c.generate([1, -2])
        with pytest.raises(errors.InvalidArgument, match="request_id must be a string, got 7"):
            c.generate("x", request_id=7)


def test_an_unknown_keyword_names_the_public_method():
    with Client("127.0.0.1:1", timeout_s=1) as c:
        with pytest.raises(TypeError, match=r"Client.generate\(\) got unexpected keyword argument\(s\) 'max_token'"):
            c.generate("x", max_token=5)

    async def go():
        async with AsyncClient("127.0.0.1:1", timeout_s=1) as c:
            with pytest.raises(TypeError, match=r"AsyncClient.stream\(\) .* 'temprature'; sampling takes max_tokens"):
                async for _ in c.stream("x", temprature=1.0):
                    pass
            with pytest.raises(errors.Unavailable):  # (past the checks: sent, and nobody is there)
                await c.generate("x", max_tokens=2)

    asyncio.run(go())


def test_each_status_maps_to_the_same_error_whatever_was_imported_first():
    """A service's own PdserveError subclass (the router's DispatchError, say) imported before the
    SDK once took INTERNAL's place in its table, and building it failed (TypeError)."""
    code = ("import grpc, services.router.dispatch, pdserve.worker.engine_thread\n"
            "from pdserve import client\n"
            "for status in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):\n"
            "    e = client._error(grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), 'boom'))\n"
            "    print(type(e).__module__, type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["pdserve.errors PdserveError INTERNAL: boom",
                                       "pdserve.errors Unavailable UNAVAILABLE: boom"]


def test_an_api_key_no_header_can_carry_is_invalid_argument_at_once():
    for key in ("ab\ncd", "clé"):
        with pytest.raises(errors.InvalidArgument, match="the API key must be printable ASCII"):
            Client("127.0.0.1:1", api_key=key)
        with pytest.raises(errors.InvalidArgument, match="the API key must be printable ASCII"):
            AsyncClient("127.0.0.1:1", api_key=key)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_a_timeout_that_is_not_a_positive_number_is_invalid_argument(timeout_s):
    """(0 fell back to the client's default, 120 s, unsaid.)"""
    with Client("127.0.0.1:1", timeout_s=1) as c:
        with pytest.raises(errors.InvalidArgument, match="timeout_s must be a positive number of seconds"):
            c.generate("x", timeout_s=timeout_s)
        with pytest.raises(errors.InvalidArgument, match="timeout_s must be a positive number"):
            list(c.stream("x", timeout_s=timeout_s))

    async def run():
        async with AsyncClient("127.0.0.1:1", timeout_s=timeout_s) as c:
            with pytest.raises(errors.InvalidArgument, match="timeout_s must be a positive number"):
                await c.generate("x")

    asyncio.run(run())


def test_the_cli_takes_a_deadline_and_refuses_one_that_is_not_positive(capsys):
    from pdserve.cli import main

    assert main(["generate", "--router", "127.0.0.1:1", "--prompt", "x", "--timeout-s", "0"]) == 2
    assert "timeout_s must be a positive number of seconds, got 0.0" in capsys.readouterr().err
    # A deadline it keeps: a peer that accepts the connection and never answers.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        t0 = time.perf_counter()
        assert main(["generate", "--router", f"127.0.0.1:{mute.getsockname()[1]}", "--prompt", "x",
                     "--timeout-s", "0.5"]) == 1
        took = time.perf_counter() - t0
    assert 0.5 <= took < 5 and "DEADLINE_EXCEEDED" in capsys.readouterr().err


def test_the_cli_ends_quietly_when_its_reader_goes():
    """`pdserve generate ... | head -c 1`: ended as by SIGPIPE (141), no traceback (there was one)."""
    cli = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "generate", "--local", "--prompt", "hi",
                            "--max-tokens", "400", "--ignore-eos"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    assert cli.stdout.read(1)
    cli.stdout.close()
    _, err = cli.communicate(timeout=120)
    assert cli.returncode == 141 and b"Traceback" not in err, err.decode()[-2000:]
