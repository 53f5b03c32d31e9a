"""docker-compose.yml and the Dockerfile: `compose config` accepts them, images are pinned, every
long-running service has a health check, and no secret is written in the file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import tool

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def compose_config(*args: str) -> dict[str, Any]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TAOTOKEN_API_KEY", "HF_TOKEN", "VLLM_MODEL", "BIND_ADDRESS", "GRAFANA_ADMIN_PASSWORD")
    }
    env["GRAFANA_ADMIN_PASSWORD"] = "test-only"
    r = subprocess.run(
        [tool("docker-compose"), "-f", str(COMPOSE), *args, "config", "--format", "yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_compose_config_default_and_gpu_profile() -> None:
    default = compose_config()
    assert set(default["services"]) == {
        "infertap",
        "prometheus",
        "alertmanager",
        "grafana",
        "otel-collector",
        "jaeger",
    }
    gpu = compose_config("--profile", "gpu")
    assert set(gpu["services"]) == set(default["services"]) | {"vllm", "infertap-gpu"}
    env = gpu["services"]["infertap-gpu"]["environment"]
    assert yaml.safe_load(env["INFERTAP_UPSTREAMS"]) == [{"name": "vllm", "base_url": "http://vllm:8000/v1"}]
    assert default["services"]["infertap"]["environment"]["TAOTOKEN_API_KEY"] == ""
    assert default["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "test-only"
    # vLLM exits at start-up on --otlp-traces-endpoint without the OpenTelemetry packages its image lacks
    assert not any("otlp" in str(arg) for arg in gpu["services"]["vllm"]["command"])


def test_fleet_profile_three_simulated_replicas_behind_one_pool() -> None:
    """`--profile fleet`: the Fleet dashboard's data with no GPU. The pool's replicas are the sim
    services, Prometheus scrapes them and the pool's infertap, and a client sends it conversations."""
    default = compose_config()
    fleet = compose_config("--profile", "fleet")
    sims = {"sim-0", "sim-1", "sim-2"}
    assert set(fleet["services"]) == set(default["services"]) | sims | {"infertap-fleet", "fleet-traffic"}
    for name in sims:
        cmd = fleet["services"][name]["command"]
        assert cmd[:5] == ["sim", "--host", "0.0.0.0", "--port", "8000"], name
        assert "healthcheck" in fleet["services"][name], name
        assert ("--slowdown" in cmd) == (name == "sim-2"), name  # one sick GPU
    proxy = fleet["services"]["infertap-fleet"]
    (mount,) = proxy["volumes"]
    assert mount["source"] == str(ROOT / "deploy" / "compose" / "fleet.toml")
    assert proxy["command"] == ["serve", "--config", mount["target"]]
    assert set(proxy["depends_on"]) >= sims
    config = tomllib.loads((ROOT / "deploy" / "compose" / "fleet.toml").read_text())
    (pool,) = config["upstreams"]
    assert pool["replicas"] == [f"http://{s}:8000/v1" for s in sorted(sims)]
    assert pool["balance"] in ("least_request", "round_robin", "prefix_affinity")
    # Listening on 0.0.0.0 in its container without client keys: said so, because it relays only to
    # the simulated replicas (see the comment in the file).
    assert config["server"]["host"] == "0.0.0.0" and config["auth"] == {"open": True}
    traffic = fleet["services"]["fleet-traffic"]
    assert traffic["entrypoint"] == ["python", "-m", "proxy.tools.bench.fleet_load"]
    assert "http://infertap-fleet:8080/v1" in traffic["command"]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert "infertap-fleet" in jobs["infertap"]["dns_sd_configs"][0]["names"]
    assert sims <= set(jobs["engine"]["dns_sd_configs"][0]["names"])


def test_every_port_is_published_on_loopback_only() -> None:
    """Docker's port rules bypass host firewalls: 8080 on all interfaces relays the API key."""
    gpu = compose_config("--profile", "gpu", "--profile", "fleet")
    published = [(name, p) for name, svc in gpu["services"].items() for p in svc.get("ports", [])]
    assert len(published) >= 6
    for name, port in published:
        assert port["host_ip"] == "127.0.0.1", (name, port)
    # The proxies listen on 0.0.0.0 in their containers, open on purpose only because of this.
    for name in ("infertap", "infertap-gpu"):
        assert gpu["services"][name]["environment"]["INFERTAP_AUTH__OPEN"] == "true", name
    text = COMPOSE.read_text()
    assert "GRAFANA_ADMIN_PASSWORD:?" in text  # no admin/admin: compose refuses to start without it


def test_compose_refuses_to_start_without_a_grafana_password() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    r = subprocess.run(
        [tool("docker-compose"), "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in r.stderr


def test_docker_compose_plugin_if_present() -> None:
    """`docker compose` (the plugin) where a Docker CLI has it; CI has only the docker-compose binary."""
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("`docker compose` is not available here (the docker-compose binary is tested above)")
    r = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "GRAFANA_ADMIN_PASSWORD": "test-only"},
    )
    assert r.returncode == 0, r.stderr


def test_pinned_images_health_checks_and_mounted_files() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    for name, svc in doc["services"].items():
        image = svc.get("image") or doc["x-infertap"]["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: pin the image ({image})"
        if name != "otel-collector":  # distroless: no shell or client to probe with (commented in the file)
            assert "healthcheck" in svc or name.startswith("infertap"), f"{name}: no health check"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: {src} does not exist"
    assert "healthcheck" in doc["x-infertap"]
    assert doc["services"]["vllm"]["profiles"] == ["gpu"]
    assert doc["services"]["vllm"]["image"].startswith("vllm/vllm-openai:v")


def test_no_secrets_in_the_file() -> None:
    text = COMPOSE.read_text()
    for m in re.finditer(r"^\s*(\w*(?:KEY|TOKEN|SECRET|PASSWORD)\w*):\s*(.*)$", text, re.M):
        # from the environment: optional (${X:-}) or required with a message (${X:?...})
        assert re.fullmatch(r"\$\{\w+(:-|:\?[^}]+)\}", m.group(2).strip()), (
            f"{m.group(1)} must come from the environment"
        )
    assert "sk-" not in text
    assert "TAOTOKEN_API_KEY: ${TAOTOKEN_API_KEY:-}" in text


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11[\w.\-]*$", text, re.M)
    assert "RUN pip install -c constraints.txt ." in text
    assert re.search(r"^USER 10001$", text, re.M)
    assert 'CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]' in text
    assert 'ENTRYPOINT ["infertap"]' in text
    ignore = (ROOT / ".dockerignore").read_text()
    for needed in ("!pyproject.toml", "!README.md", "!constraints.txt", "!proxy/"):
        assert needed in ignore
    for path in re.findall(r"^COPY (\S+)", text, re.M) + ["README.md"]:
        assert (ROOT / path).exists(), path


def test_constraints_pin_every_runtime_dependency() -> None:
    """Image builds install exactly the versions CI tested (scripts/pin_constraints.py writes them)."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        req = Requirement(dep)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{name} is not in constraints.txt: run scripts/pin_constraints.py"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} does not satisfy {dep}"
