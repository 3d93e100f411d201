"""compose.yaml passes the compose schema check and wires every service; the Dockerfile installs
exactly what the README installs."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from pdserve.runtime.launch import MooncakeMaster
from tests.support.procs import ROOT

SERVICES = {"secrets", "redis", "jaeger", "kvstore", "prefill", "decode", "router"}


def test_compose_file_is_valid_and_names_every_service(tmp_path):
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is needed for this check: bash scripts/setup.sh --test installs it"
    out = subprocess.run([exe, "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    # (docker-compose 1.x lists the services of every profile; 2.x those of the default one)
    cluster_only = {"mooncake-master", "kvstore-b", "prefill-b", "decode-b"}
    assert set(resolved["services"]) - cluster_only == SERVICES
    assert all(resolved["services"][n]["profiles"] == ["cluster"] for n in cluster_only & set(resolved["services"]))
    for name in ("kvstore", "prefill", "decode", "router"):
        svc = resolved["services"][name]
        assert svc["command"][:3] == ["python", "-m", f"services.{name}"]
        assert "pdserve.runtime.healthcheck" in svc["healthcheck"]["test"]
        assert svc["environment"]["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert all(dep["condition"] == "service_healthy" for n, dep in svc["depends_on"].items() if n != "secrets")
        # Every service reads the one token the `secrets` service wrote into the shared volume.
        assert svc["environment"]["PDSERVE_SERVICE_TOKEN_FILE"] == "/run/pdserve/service-token"
        assert "secrets:/run/pdserve:ro" in svc["volumes"]
    assert resolved["services"]["kvstore"]["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    assert resolved["services"]["secrets"]["command"] == ["python", "-m", "pdserve.runtime.auth", "/run/pdserve"]
    assert resolved["services"]["router"]["depends_on"].keys() == {"prefill", "decode"}
    assert "16686" in str(resolved["services"]["jaeger"]["ports"])
    router = resolved["services"]["router"]
    assert router["environment"]["PDSERVE_HTTP_PORT"] == "8000" and "8000" in str(router["ports"])
    assert all(resolved["services"][n]["build"]["args"]["TORCH"] == "cpu" for n in ("router", "secrets"))
    # The "cluster" profile: a master and a second node (store, prefill, decode), its workers at it.
    out = subprocess.run([exe, "-f", str(ROOT / "compose.yaml"), "--profile", "cluster", "config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    cluster = yaml.safe_load(out.stdout)["services"]
    assert set(cluster) == SERVICES | cluster_only
    assert cluster["mooncake-master"]["command"][0] == "mooncake_master"
    assert f"--default_kv_lease_ttl={MooncakeMaster.KV_LEASE_MS}" in cluster["mooncake-master"]["command"]
    node_b = cluster["kvstore-b"]["environment"]
    assert (node_b["PDSERVE_NODE"], node_b["PDSERVE_CLUSTER_STORE"], node_b["PDSERVE_CLUSTER_MASTER"]) == (
        "b", "mooncake", "172.28.0.20:50051")
    assert cluster["kvstore"]["environment"]["PDSERVE_CLUSTER_MASTER"] == node_b["PDSERVE_CLUSTER_MASTER"]
    assert {cluster[n]["environment"]["PDSERVE_STORE"] for n in ("prefill-b", "decode-b")} == {"172.28.0.21:50051"}
    # A broken file is caught: the check can fail.
    broken = tmp_path / "compose.yaml"
    broken.write_text((ROOT / "compose.yaml").read_text().replace("condition: service_healthy",
                                                                   "condition: when_it_feels_like_it", 1))
    bad = subprocess.run([exe, "-f", str(broken), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


def test_dockerfile_uses_the_readme_install():
    text = (ROOT / "Dockerfile").read_text()
    assert "bash scripts/setup.sh" in text and "ARG TORCH=cpu" in text
    assert "https://download.pytorch.org/whl/cpu" in text
    assert "bash scripts/run.sh" in (ROOT / "README.md").read_text()
