"""deploy/kubernetes: kustomize renders it, kubernetes-validate --strict accepts every built-in kind
(the Prometheus Operator CRDs ServiceMonitor and PrometheusRule have no schema there: their rules are
checked with promtool instead), and the manifests follow the conventions the rest relies on."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import tool

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    r = subprocess.run([tool("kubectl"), "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    path.write_text(r.stdout)
    return path, [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_kinds(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    kinds = sorted(d["kind"] for d in rendered[1])
    assert kinds == sorted(
        [
            "Namespace",
            "ConfigMap",
            "ConfigMap",
            "Deployment",
            "Service",
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
            "ServiceMonitor",
            "PrometheusRule",
        ]
    )
    assert all(d["metadata"].get("namespace") == "infertap" for d in rendered[1] if d["kind"] != "Namespace")


def test_kubernetes_validate_strict(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    r = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(rendered[0])],
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "ERROR" not in out
    passed = out.count(" passed for resource ")
    assert passed == len(rendered[1]) - 2, out  # all but the two CRDs


def test_deployment(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    (dep,) = by_kind(rendered[1], "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["ports"][0]["containerPort"] == 8080
    assert c["resources"]["requests"] and c["resources"]["limits"]
    env = {e["name"]: e for e in c["env"]}
    assert set(env) == {"TAOTOKEN_API_KEY", "INFERTAP_CLIENT_KEYS"}
    for key in env.values():
        assert key["valueFrom"]["secretKeyRef"]["name"] == "infertap-keys"
    # It listens on 0.0.0.0: without client keys infertap would not start, so the pod must not either.
    assert not env["INFERTAP_CLIENT_KEYS"]["valueFrom"]["secretKeyRef"].get("optional", False)
    configmaps = {d["metadata"]["name"] for d in by_kind(rendered[1], "ConfigMap")}
    (cfg_volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert cfg_volume["configMap"]["name"] in configmaps  # kustomize rewrote the hashed name
    assert "/etc/infertap/config.toml" in c["args"]
    # The HPA owns the replica count: a replicas field would reset it on every apply.
    assert "replicas" not in dep["spec"]
    (hpa,) = by_kind(rendered[1], "HorizontalPodAutoscaler")
    assert hpa["spec"]["minReplicas"] >= 2
    # The kubelet's default probe timeout is 1 s: a loaded pod would flap.
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["timeoutSeconds"] >= 2, probe


def test_grace_period_covers_prestop_and_infertaps_drain(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    """SIGTERM comes after preStop; then infertap serves new requests for drain_delay and lets streams
    finish for drain_timeout. The kubelet kills the pod at terminationGracePeriodSeconds, counted from
    the start of preStop: it must cover all three, with a margin."""
    (dep,) = by_kind(rendered[1], "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    pre_stop = float(command[1])
    drain = drain_settings()
    assert set(drain) == {"drain_delay", "drain_timeout"}
    # long enough for endpoint removal to reach kube-proxy and ingresses, short next to the drain
    assert 2 <= pre_stop <= 15 and pre_stop <= drain["drain_timeout"]
    margin = 5
    assert (
        pod["terminationGracePeriodSeconds"]
        >= pre_stop + drain["drain_delay"] + drain["drain_timeout"] + margin
    )


def drain_settings() -> dict[str, float]:
    return {
        k: float(v)
        for k, v in tomllib.loads((K8S / "config.toml").read_text())["server"].items()
        if k.startswith("drain_")
    }


def test_config_toml_loads() -> None:
    settings_module = pytest.importorskip("proxy.settings")
    path = K8S / "config.toml"
    settings = settings_module.load_settings(path)
    assert settings.server.host == "0.0.0.0" and settings.server.port == 8080
    assert any(u.api_key_env == "TAOTOKEN_API_KEY" for u in settings.upstreams)
    # Beyond loopback: with client keys (from the Secret), or `infertap serve` refuses to start.
    assert settings.auth.keys_env == "INFERTAP_CLIENT_KEYS" and not settings.auth.open
    exposure = pytest.importorskip("proxy.server.exposure")
    exposure.refuse_open_beyond_loopback(settings)


def test_dashboards_configmap(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    (cm,) = [
        d
        for d in by_kind(rendered[1], "ConfigMap")
        if d["metadata"]["name"].startswith("infertap-dashboards")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    for name in (p.name for p in (ROOT / "dashboards").glob("*.json")):
        assert json.loads(cm["data"][name]) == json.loads((ROOT / "dashboards" / name).read_text())


def test_prometheusrule_is_the_same_rules_and_valid(
    rendered: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    (rule,) = by_kind(rendered[1], "PrometheusRule")
    groups = []
    for f in ("infertap-recording.yml", "infertap-alerts.yml", "infertap-spend.yml", "infertap-fleet.yml"):
        groups += yaml.safe_load((ROOT / "deploy/prometheus/rules" / f).read_text())["groups"]
    assert rule["spec"]["groups"] == groups
    out = tmp_path / "rules.yml"
    out.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = subprocess.run(
        [tool("promtool"), "check", "rules", str(out)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_servicemonitor_selects_the_service(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    (sm,) = by_kind(rendered[1], "ServiceMonitor")
    # The operator's CRD has scrapeProtocols under spec; under an endpoint it is an unknown field.
    assert sm["spec"]["scrapeProtocols"][0] == "OpenMetricsText1.0.0"
    assert all("scrapeProtocols" not in e for e in sm["spec"]["endpoints"])
    (svc,) = by_kind(rendered[1], "Service")
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert labels[sm["spec"]["jobLabel"]] == "infertap"  # up{job="infertap"} in InfertapProxyDown


def test_kube_prometheus_stack_overlay_adds_the_release_label() -> None:
    r = subprocess.run(
        [tool("kubectl"), "kustomize", str(ROOT / "deploy" / "kube-prometheus-stack")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    for kind in ("ServiceMonitor", "PrometheusRule"):
        (doc,) = by_kind(docs, kind)
        assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
    assert len(docs) == 9  # everything else of the base comes along


def test_image_is_a_real_reference_at_this_version() -> None:
    from proxy import __version__

    (image,) = yaml.safe_load((K8S / "kustomization.yaml").read_text())["images"]
    assert "example" not in image["newName"] and "/" in image["newName"]
    assert image["newTag"] == __version__


POOL = ROOT / "deploy" / "vllm-pool"


@pytest.fixture(scope="module")
def pool_rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    r = subprocess.run([tool("kubectl"), "kustomize", str(POOL)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path = tmp_path_factory.mktemp("k8s-pool") / "rendered.yaml"
    path.write_text(r.stdout)
    return path, [d for d in yaml.safe_load_all(r.stdout) if d]


def test_pool_example_is_valid(pool_rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    r = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(pool_rendered[0])],
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR" not in out, out
    assert out.count(" passed for resource ") == len(pool_rendered[1]) - 2, out


def test_pool_example_headless_service_names_the_ready_vllm_pods_infertap_resolves(
    pool_rendered: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The pool's `dns://NAME:PORT/v1` is the headless Service of the vLLM Deployment: one A record
    per ready pod (no kube-proxy in between), on the port vLLM listens on."""
    docs = pool_rendered[1]
    (vllm,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "vllm"]
    (svc,) = [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "vllm"]
    ns = vllm["metadata"]["namespace"]
    assert svc["metadata"]["namespace"] == ns != "infertap"
    assert svc["spec"]["clusterIP"] == "None"
    pod = vllm["spec"]["template"]
    assert all(pod["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())
    (c,) = pod["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # DNS lists ready pods only
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] == c["ports"][0]["name"] and c["ports"][0]["containerPort"] == 8000
    # The base's ConfigMap, replaced: the one the infertap Deployment mounts holds the pool.
    (infertap,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "infertap"]
    mounted = {
        v["configMap"]["name"] for v in infertap["spec"]["template"]["spec"]["volumes"] if "configMap" in v
    }
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] in mounted]
    config = tomllib.loads(cm["data"]["config.toml"])
    (pool,) = [u for u in config["upstreams"] if "replicas" in u]
    assert "base_url" not in pool
    assert pool["replicas"] == [f"dns://{svc['metadata']['name']}.{ns}.svc.cluster.local:{port['port']}/v1"]
    # Otherwise the base's config: drain timings and the other upstream unchanged.
    base = tomllib.loads((K8S / "config.toml").read_text())
    assert config["server"] == base["server"]
    assert [u for u in config["upstreams"] if u["name"] != pool["name"]] == [
        u for u in base["upstreams"] if u["name"] != pool["name"]
    ]


@pytest.mark.parametrize(
    "path", [POOL / "config.toml", ROOT / "deploy" / "compose" / "fleet.toml"], ids=lambda p: p.parent.name
)
def test_pool_configs_load(path: Path) -> None:
    """The pool examples (Kubernetes `dns://`, compose's three sims) are configs infertap accepts."""
    from proxy.settings import load_settings
    from proxy.settings.upstreams import UpstreamSettings

    if "replicas" not in UpstreamSettings.model_fields:
        pytest.skip("this infertap has no replica pools yet (issue 26's proxy side, branch pools)")
    settings = load_settings(path)
    (pool,) = [u for u in settings.upstreams if getattr(u, "replicas", None)]
    assert pool.balance in ("least_request", "round_robin", "prefix_affinity")
