"""TLS on every port: a whole stack with one CA (made here with openssl) speaks mTLS inside and
TLS on the router's client port; plaintext and certificate-less callers get nowhere."""

from __future__ import annotations

import ssl
import subprocess
import time
import uuid

import grpc
import httpx
import pytest

from pdserve import errors
from pdserve.client import Client
from pdserve.v1 import decode_pb2_grpc, prefill_pb2
from tests.support.credentials import SERVICE_METADATA
from tests.support.procs import SERVING
from tests.support.stack import Stack


def make_ca(d) -> dict[str, str]:
    """A CA and one certificate it signs for 127.0.0.1 and localhost (the store's Unix address)."""
    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=pdserve-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "svc.key", "-out", "svc.csr", "-subj", "/CN=pdserve")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl("x509", "-req", "-in", "svc.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "svc.pem", "-days", "1", "-extfile", "ext.cnf")
    return {"PDSERVE_TLS_CERT": str(d / "svc.pem"), "PDSERVE_TLS_KEY": str(d / "svc.key"),
            "PDSERVE_TLS_CA": str(d / "ca.pem")}


def check_health(address: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode | int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status
    except grpc.RpcError as e:
        return e.code()
    finally:
        ch.close()


def test_mtls_inside_tls_at_the_router_and_no_plaintext(shared_redis_url, tmp_path):
    files = make_ca(tmp_path)
    s = Stack(shared_redis_url, f"pdtest-tls-{uuid.uuid4().hex[:8]}", env=files)
    try:
        s.start(num_prefill=1, num_decode=1)  # workers reach the store over mTLS, or never start
        port_file = tmp_path / "http-port"
        s.start_router("--http-port", "0", "--http-port-file", str(port_file), env=files)
        ca = files["PDSERVE_TLS_CA"]
        http = f"127.0.0.1:{int(port_file.read_text())}"  # the OpenAI API: HTTPS with the same certificate
        with httpx.Client(verify=ssl.create_default_context(cafile=ca), timeout=10) as h:
            assert h.get(f"https://{http}/health").json()["status"] == "ok"
        with httpx.Client(timeout=10) as h, pytest.raises(httpx.HTTPError):  # no API key in clear
            h.get(f"http://{http}/health")
        with Client(s.router.address, ca_path=ca) as c:  # TLS, no client certificate: an API key
            deadline = time.time() + 20
            while sum(w.healthy for w in c.status().workers) < 2:  # router -> workers over mTLS
                assert time.time() < deadline, "the pool never became healthy over mTLS"
                time.sleep(0.2)
            assert len(c.generate([9] * 40, max_tokens=3, ignore_eos=True).token_ids) == 3
        with Client(s.router.address) as c, pytest.raises(errors.Unavailable):  # plaintext to a TLS port
            c.status()
        pem = {k: open(v, "rb").read() for k, v in files.items()}
        server_only = grpc.ssl_channel_credentials(pem["PDSERVE_TLS_CA"])
        mutual = grpc.ssl_channel_credentials(pem["PDSERVE_TLS_CA"], pem["PDSERVE_TLS_KEY"], pem["PDSERVE_TLS_CERT"])
        for p in (s.store, s.prefills[0], s.decodes[0]):
            assert check_health(p.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
            assert check_health(p.address, server_only) == grpc.StatusCode.UNAVAILABLE  # no client certificate
            assert check_health(p.address, mutual) == SERVING
        assert check_health(s.router.address, server_only) == SERVING  # the client port asks no certificate
        # A certificate is not a credential: an internal RPC still wants the service token.
        with grpc.secure_channel(s.decodes[0].address, mutual) as ch:
            cancel = decode_pb2_grpc.DecodeStub(ch).Cancel
            with pytest.raises(grpc.RpcError) as refused:
                cancel(prefill_pb2.CancelRequest(request_id="x"), timeout=3)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not cancel(prefill_pb2.CancelRequest(request_id="x"), timeout=3, metadata=SERVICE_METADATA).found
    finally:
        s.stop()
