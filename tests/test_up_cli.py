"""`pdserve up` starts the stack; the CLI talks to it; SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.procs import ROOT


def children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.add(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_up_generate_status_and_clean_stop(tiny, tmp_path):
    logs = tmp_path / "logs"
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", "0", "--log-dir",
                           str(logs), "--key-prefix", f"pdtest-up-{os.getpid()}"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    try:
        line = up.stdout.readline()
        assert line.startswith("router at "), line
        router = line.split()[-1]
        name, _, key = up.stdout.readline().strip().partition("=")  # one line to paste into a shell
        assert name == "PDSERVE_API_KEY" and len(key) >= 32 and key != os.environ["PDSERVE_API_KEY"]
        env = {**os.environ, "PDSERVE_API_KEY": key}
        openai_line = up.stdout.readline()
        assert openai_line.startswith("OpenAI API at http://127.0.0.1:") and openai_line.strip().endswith("/v1")
        api = openai_line.split()[-1]
        kids = children(up.pid)
        assert len(kids) >= 4  # store, prefill, decode, router (+ redis when none was reachable)
        for k in kids:  # the stack's secrets are in no command line `ps` shows
            with open(f"/proc/{k}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
        stranger = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--router", router], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
        assert stranger.returncode == 1 and "UNAUTHENTICATED" in stranger.stderr  # (the session's key)
        gen = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--router", router, "--prompt",
                              "hello", "--max-tokens", "5", "--ignore-eos", "--json"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, env=env)
        assert gen.returncode == 0, gen.stderr
        doc = json.loads(gen.stdout)
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.engine import LLMEngine
        from pdserve.engine.sampling import SamplingParams

        want = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate(
            [tiny.tokenizer.encode("hello")], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
        assert doc["token_ids"] == want and doc["prompt_tokens"] == 5 and doc["ttft_ms"] > 0
        import httpx

        r = httpx.post(f"{api}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["pdserve"]["token_ids"] == want
        st = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--router", router, "--api-key", key],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "redis: connected" in st.stdout
        assert "prefill" in st.stdout and "decode" in st.stdout
        bad = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--router", router, "--prompt", "",
                              "--max-tokens", "5"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 2 and "INVALID_ARGUMENT: prompt is empty" in bad.stderr
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        deadline = time.time() + 10
        while any(alive(k) for k in kids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(k) for k in kids), "orphans left behind"
        names = sorted(p.name for p in logs.glob("*.log"))
        assert names == ["decode-0.log", "kvstore.log", "prefill-0.log", "router.log"]
        requests = [json.loads(line) for line in (logs / "router.log").read_text().splitlines()
                    if '"event": "request"' in line]
        assert [(r["status"], r["output_tokens"], r["prompt_tokens"]) for r in requests] == [("OK", 5, 5)] * 2
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)


def test_no_service_outlives_a_killed_up():
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", "0", "--key-prefix",
                           f"pdtest-upkill-{os.getpid()}"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    try:
        assert up.stdout.readline().startswith("router at ")
        kids = children(up.pid)
        assert len(kids) >= 4
        up.kill()  # no chance to clean up: the children must still go (parent-death signal)
        up.wait(10)
        deadline = time.time() + 15
        while any(alive(k) for k in kids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(k) for k in kids), "orphans left behind"
    finally:
        if up.poll() is None:
            up.kill()


def test_demo_output_escapes_what_a_terminal_would_run():
    from pdserve.up import printable

    assert printable("ok\x1b[2J\x07é\n\tend\x00") == "ok\\x1b[2J\\x07é\n\tend\\x00"


def _up(*flags: str, env: dict[str, str] | None = None, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", "-1", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def _child(pid: int, word: str) -> int | None:
    """The pid of `pid`'s child whose command line holds `word`, if one does."""
    for k in children(pid):
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if word.encode() in f.read():
                    return k
        except OSError:
            continue
    return None


def _stopped(up: subprocess.Popen, kids: set[int], timeout_s: float) -> int:
    """`up`'s exit status once it and every child in `kids` are gone (fails past `timeout_s`)."""
    rc = up.wait(timeout_s)
    deadline = time.time() + 10
    while any(alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(k) for k in kids), "orphans left behind"
    return rc


def test_ups_own_redis_wants_a_password_and_its_loss_stops_up(tmp_path):
    from urllib.parse import urlsplit

    from tests.support.procs import listening

    err = tmp_path / "up.err"
    with open(err, "w") as stderr:
        up = _up("--key-prefix", f"pdtest-uppw-{os.getpid()}", stderr=stderr)
    try:
        assert up.stdout.readline().startswith("router at ")
        kids = children(up.pid)
        redis_pid = _child(up.pid, "redis-server")
        assert redis_pid, "up started no redis-server"
        with open(f"/proc/{_child(up.pid, 'services.kvstore')}/environ", "rb") as f:
            env = dict(v.split("=", 1) for v in f.read().decode().split("\0") if "=" in v)
        password = urlsplit(env["PDSERVE_REDIS_URL"]).password
        assert password and len(password) >= 24  # the services get it by environment ...
        for k in kids:  # ... and no command line shows it
            with open(f"/proc/{k}/cmdline", "rb") as f:
                assert password.encode() not in f.read()
        ((_, port),) = listening(redis_pid)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(64).startswith(b"-NOAUTH")  # a local user without it gets nothing
        # Its Redis gone, `up` says so and stops everything with a failure.
        os.kill(redis_pid, signal.SIGKILL)
        assert _stopped(up, kids, 30) == 1
        out = up.stdout.read() + err.read_text()
        assert "redis-server (code -9) exited" in out
        assert password not in out
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_startup_stops_up_at_once(tmp_path, sig):
    up = _up("--key-prefix", f"pdtest-upint-{os.getpid()}", stderr=subprocess.PIPE)
    try:
        for line in up.stderr:  # a service is starting: the stack is half up
            if "started our own redis" in line:
                break
        deadline = time.time() + 30
        while _child(up.pid, "services.kvstore") is None:
            assert time.time() < deadline, "no store started"
            time.sleep(0.05)
        kids = children(up.pid)
        up.send_signal(sig)
        assert _stopped(up, kids, 10) == 128 + sig
        assert up.stdout.read() == ""  # it went on to start nothing more: no router, no key
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine other than loopback (the source of its default route), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # (UDP: sends nothing)
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_up_serves_on_a_non_loopback_host():
    from pdserve.client import Client

    host = _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    up = _up("--host", host, "--key-prefix", f"pdtest-uphost-{os.getpid()}")
    try:
        line = up.stdout.readline()
        assert line.startswith(f"router at {host}:"), line
        key = up.stdout.readline().strip().partition("=")[2]
        with Client(line.split()[-1], api_key=key, timeout_s=30) as c:
            assert [w.healthy for w in c.status().workers] == [True, True]
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def test_dial_host_unit():
    """(The address helper alone.)"""
    from pdserve.up import dial_host

    assert [dial_host(h) for h in ("0.0.0.0", "", "::", "127.0.0.1", "10.1.2.3", "fe80::1", "[::1]", "box")] == [
        "127.0.0.1", "127.0.0.1", "[::1]", "127.0.0.1", "10.1.2.3", "[fe80::1]", "[::1]", "box"]


def test_a_named_prefix_holding_keys_is_refused_and_kept():
    import secrets

    from pdserve.cluster import connect_sync
    from tests.support.procs import RedisServer

    server = RedisServer(password=secrets.token_urlsafe(24)).start()
    try:
        prefix = f"pdtest-upkeep-{os.getpid()}"
        client = connect_sync(server.url, 5)
        client.set(f"{prefix}:theirs", "1")  # a deployment already under that prefix
        up = _up("--key-prefix", prefix, "--exit-after-demo", stderr=subprocess.PIPE,
                 env={**os.environ, "REDIS_URL": server.url})
        out, err = up.communicate(timeout=120)
        assert up.returncode == 2 and f"--key-prefix {prefix}: " in err and "already holds keys" in err, err
        assert client.get(f"{prefix}:theirs") == b"1"
        assert server.password not in out + err
        client.close()
    finally:
        server.stop()


def test_up_refused_for_its_arguments_leaves_no_log_directory(tmp_path):
    """(A refused run made its log directory first, and said 'logs kept in' an empty one.)"""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--store-nodes", "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "each store node needs a prefill and a decode worker" in out.stderr
    assert list(tmp_path.iterdir()) == [] and "logs kept" not in out.stderr + out.stdout
