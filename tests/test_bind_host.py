"""The bind interposer (pdserve/runtime/bind_host.py) in a process of its own, preloaded: which
binds it moves and which it leaves alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pdserve.runtime import bind_host
from tests.support.procs import ROOT

PROBE = r"""
import errno, json, socket, threading
from pdserve.runtime import bind_host

def bound(family, host):
    s = socket.socket(family)
    try:
        s.bind((host, 0))
        return s.getsockname()[0]
    except OSError as e:
        return errno.errorcode[e.errno]
    finally:
        s.close()

out = {}
with bind_host.confined("127.0.0.1"):
    out["v4 any"] = bound(socket.AF_INET, "0.0.0.0")
    out["v6 any"] = bound(socket.AF_INET6, "::")
    out["v4 named"] = bound(socket.AF_INET, "127.0.0.2")
    other = []
    t = threading.Thread(target=lambda: other.append(bound(socket.AF_INET, "0.0.0.0")))
    t.start(); t.join()
    out["v4 any, another thread"] = other[0]
out["v4 any, after"] = bound(socket.AF_INET, "0.0.0.0")
with bind_host.confined("localhost"):
    out["v4 any, a name"] = bound(socket.AF_INET, "0.0.0.0")
with bind_host.confined("::1"):
    out["v4 any, v6 host"] = bound(socket.AF_INET, "0.0.0.0")
    out["v6 any, v6 host"] = bound(socket.AF_INET6, "::")
with bind_host.confined("0.0.0.0"):
    out["v4 any, wildcard host"] = bound(socket.AF_INET, "0.0.0.0")
print(json.dumps(out))
"""


def test_wildcard_binds_on_the_confined_thread_land_on_the_host_and_nothing_else_moves():
    env = {**os.environ, **bind_host.preload_env()}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "v4 any": "127.0.0.1",
        "v6 any": "::ffff:127.0.0.1",  # the IPv4-mapped form: reachable from 127.0.0.1 only
        "v4 named": "127.0.0.2",
        "v4 any, another thread": "0.0.0.0",
        "v4 any, after": "0.0.0.0",
        "v4 any, a name": "127.0.0.1",
        "v4 any, v6 host": "EADDRNOTAVAIL",  # never wider than configured
        "v6 any, v6 host": "::1",
        "v4 any, wildcard host": "0.0.0.0",
    }


def test_preload_env_keeps_another_preload_and_adds_itself_once():
    lib = str(bind_host.library())
    assert bind_host.preload_env({}) == {"LD_PRELOAD": lib}
    assert bind_host.preload_env({"LD_PRELOAD": "/x/other.so"}) == {"LD_PRELOAD": f"{lib} /x/other.so"}
    assert bind_host.preload_env({"LD_PRELOAD": f"/x/other.so {lib}"}) == {"LD_PRELOAD": f"/x/other.so {lib}"}
