"""charts/ rendered with real Helm (the Helm v4 Go SDK through helm-python-sdk,
offline): lint clean, every manifest valid for Kubernetes 1.29 and 1.33, and the
rendered mesh wired as the values say — addresses, groups, probes, GPUs, hardening —
read back from the manifests a cluster would receive."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from orchestrator.pipeline import load_pipeline, parse_pipeline
from services.stage.config import parse_stage_config
from tests.deploy.chart import CHART_DIR, load_values, merge, render

REPO = Path(__file__).resolve().parents[2]
KUBE_VERSIONS = ("1.29.0", "1.33.0")
PODMAN_VALUES = CHART_DIR / "ci" / "podman-values.yaml"

GPU = {
    "stages": {
        "thinker": {
            "engine": "vllm",
            "model": "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
            "gpus": 2,
            "image": {"tag": "gpu"},
            "runtimeClassName": "nvidia",
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
        }
    },
    "modelCache": {"type": "pvc"},
}
GROUP = {
    "stages": {"thinker": {"group": "pair"}, "renderer": {"group": "pair"}},
    "groups": {"pair": {"shmSize": "2Gi", "cudaIpc": True, "nodeSelector": {"pool": "a"}}},
}
REPLICAS = {"stages": {"thinker": {"replicas": 3}, "renderer": {"replicas": 2}}}
TLS = {
    "tls": {"secretName": "omni-tls"},
    "auth": {"secretName": "omni-auth"},
    "otel": {"endpoint": "http://otel-collector:4317"},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": GPU,
    "group": GROUP,
    "replicas": REPLICAS,
    "tls": TLS,
    "podman": load_values(PODMAN_VALUES),
}


# --- reading the manifests --------------------------------------------------------


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def config_file(docs: list[dict[str, Any]], configmap: str, key: str) -> dict[str, Any]:
    return yaml.safe_load(by_kind(docs, "ConfigMap")[configmap]["data"][key])


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: d["spec"]["template"]["spec"] for n, d in by_kind(docs, "Deployment").items()}


def containers(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every container by name, with the pod spec it runs in."""
    return {c["name"]: (c, spec) for spec in pod_specs(docs).values() for c in spec["containers"]}


def flag(container: dict[str, Any], name: str) -> str:
    args = container["args"]
    return args[args.index(name) + 1]


def pod_of(docs: list[dict[str, Any]], service: dict[str, Any]) -> dict[str, Any]:
    """The one Deployment whose Pods the Service selects."""
    selector = service["spec"]["selector"]
    matches = [
        d
        for d in by_kind(docs, "Deployment").values()
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(matches) == 1, (
        service["metadata"]["name"],
        [m["metadata"]["name"] for m in matches],
    )
    return matches[0]


# --- Helm itself ------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_lint_strict_is_clean(variant: str, kube: str) -> None:
    report = helm_python.lint(CHART_DIR, VARIANTS[variant], strict=True, kube_version=f"v{kube}")
    # --strict: warnings (2) count as errors (3); INFO (1) is advice ("icon is recommended").
    problems = [m for m in report["messages"] if m["severity"] != 1]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_is_valid_for_kubernetes_1_29_and_1_33(variant: str) -> None:
    docs = render(VARIANTS[variant])
    assert docs
    for doc in docs:
        for kube in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, kube, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{variant}: {doc['kind']} {doc['metadata']['name']} ({kube}): {exc}")


def test_defaults_deploy_the_default_pipeline() -> None:
    docs = render()
    names = {"omni-orchestrator", "omni-thinker", "omni-renderer"}
    assert set(by_kind(docs, "Deployment")) == set(by_kind(docs, "Service")) == names
    assert set(by_kind(docs, "NetworkPolicy")) == {"omni-stages"}
    assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}
    # The chart's stages are the example pipeline's (examples/pipelines/default.yaml),
    # setting for setting, so `helm install` and `omni up` run the same mesh.
    example = load_pipeline(REPO / "examples" / "pipelines" / "default.yaml")
    rendered = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    assert rendered.edges == example.edges and rendered.outputs == example.outputs
    assert rendered.watchdog == example.watchdog
    for stage in example.stages:
        assert stage.launch is not None
        assert config_file(docs, "omni-stages", f"{stage.name}.yaml") == yaml.safe_load(
            stage.launch.read_text()
        )
        assert rendered.stage(stage.name).init_timeout_s == stage.init_timeout_s


# --- wiring -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["defaults", "group", "replicas", "gpu"])
def test_stage_addresses_are_the_rendered_services(variant: str) -> None:
    docs = render(VARIANTS[variant], namespace="mesh")
    pipeline = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    services = by_kind(docs, "Service")
    stage_files = by_kind(docs, "ConfigMap")["omni-stages"]["data"]
    assert sorted(pipeline.names) == sorted(k.removesuffix(".yaml") for k in stage_files)
    for stage in pipeline.stages:
        address = stage.require_address()
        prefix, _, port = address.rpartition(":")
        assert prefix.startswith("dns:///") and prefix.endswith(".mesh.svc.cluster.local")
        name = prefix.removeprefix("dns:///").split(".")[0]
        service = services[name]
        # Headless: DNS answers with every replica, the orchestrator round-robins.
        assert service["spec"]["clusterIP"] == "None"
        assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
        assert service["spec"]["ports"][0]["targetPort"] == int(port)
        deployment = pod_of(docs, service)
        (container,) = [
            c
            for c in deployment["spec"]["template"]["spec"]["containers"]
            if c["name"] == stage.name
        ]
        # The gRPC port, and the plaintext health-only port the probes dial.
        health = str(int(port) + 1000)
        assert [p["containerPort"] for p in container["ports"]] == [int(port), int(health)]
        assert flag(container, "--port") == port and flag(container, "--host") == "0.0.0.0"
        assert flag(container, "--health-port") == health
        assert flag(container, "--config") == f"/etc/omni/stages/{stage.name}.yaml"
        # The stage file it reads is valid for the stage service itself.
        parse_stage_config(yaml.safe_load(stage_files[f"{stage.name}.yaml"]), stage.name)
    (orchestrator,) = pod_specs(docs)["omni-orchestrator"]["containers"]
    assert flag(orchestrator, "--pipeline") == "/etc/omni/pipeline/pipeline.yaml"


def test_grouped_stages_share_one_pod_and_its_shm() -> None:
    docs = render(GROUP)
    specs = pod_specs(docs)
    assert set(specs) == {"omni-orchestrator", "omni-pair"}
    spec = specs["omni-pair"]
    assert [c["name"] for c in spec["containers"]] == ["renderer", "thinker"]
    assert spec["shareProcessNamespace"] is True  # cudaIpc: true
    assert spec["nodeSelector"] == {"pool": "a"}
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    for container in spec["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm"
        assert "runAsUser" not in container["securityContext"]  # the Pod's one uid
    assert spec["securityContext"]["runAsUser"] == spec["securityContext"]["fsGroup"] == 10001
    # Both stages' Services lead to that one Pod, at their own ports.
    services = by_kind(docs, "Service")
    for stage in ("thinker", "renderer"):
        assert pod_of(docs, services[f"omni-{stage}"])["metadata"]["name"] == "omni-pair"
    # A group without cudaIpc keeps its own process namespace per container.
    plain = render(merge(GROUP, {"groups": {"pair": {"cudaIpc": False}}}))
    assert "shareProcessNamespace" not in pod_specs(plain)["omni-pair"]


def test_replicas_render_as_deployment_replicas_behind_headless_services() -> None:
    docs = render(REPLICAS)
    deployments = by_kind(docs, "Deployment")
    assert deployments["omni-thinker"]["spec"]["replicas"] == 3
    assert deployments["omni-renderer"]["spec"]["replicas"] == 2
    assert deployments["omni-orchestrator"]["spec"]["replicas"] == 1
    for name in ("omni-thinker", "omni-renderer"):
        service = by_kind(docs, "Service")[name]["spec"]
        assert service["clusterIP"] == "None"
        # The watchdog follows a starting replica's InitStatus (downloads pause it).
        assert service["publishNotReadyAddresses"] is True


def test_gpu_limits_only_where_asked() -> None:
    docs = render(GPU)
    found = containers(docs)
    thinker, spec = found["thinker"]
    assert thinker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert thinker["resources"]["limits"]["memory"] == "4Gi"  # the stage's own limits kept
    assert thinker["image"] == "ghcr.io/omni-mesh/omni:gpu"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    stage_file = config_file(docs, "omni-stages", "thinker.yaml")
    assert stage_file["engine"] == "vllm" and stage_file["runtime"]["device"] == "cuda"
    for name, (container, other_spec) in found.items():
        if name != "thinker":
            assert "nvidia.com/gpu" not in container.get("resources", {}).get("limits", {}), name
            assert "runtimeClassName" not in other_spec, name
    for variant in ("defaults", "group", "replicas", "tls"):
        rendered = yaml.safe_dump_all(render(VARIANTS[variant]))
        assert "nvidia.com/gpu" not in rendered, variant
    # The model cache on a claim the chart creates, mounted where stages cache.
    assert by_kind(docs, "PersistentVolumeClaim")["omni-model-cache"]["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]
    (cache,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
    assert cache["persistentVolumeClaim"]["claimName"] == "omni-model-cache"


def test_probes_ask_the_right_services_within_the_watchdog_budget() -> None:
    docs = render()
    values = helm_python.Chart.load(CHART_DIR).values
    pipeline = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    for name, (container, _spec) in containers(docs).items():
        # Probes dial the plaintext health-only port, which a TLS secret leaves alone.
        port = int(flag(container, "--health-port"))
        assert port == int(flag(container, "--port")) + values["probes"]["healthPortOffset"]
        assert port in [p["containerPort"] for p in container["ports"]]
        startup, live, ready = (
            container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")
        )
        assert startup["grpc"] == live["grpc"] == {"port": port, "service": "liveness"}
        expected = "omni.v1.Orchestrator" if name == "orchestrator" else "omni.v1.Stage"
        assert ready["grpc"] == {"port": port, "service": expected}
        budget = (
            values["orchestrator"]["initTimeoutS"]
            if name == "orchestrator"
            else pipeline.stage(name).init_timeout_s
        )
        # The startup probe waits at least as long as the watchdog would.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= budget
        assert startup["failureThreshold"] == math.ceil(budget / startup["periodSeconds"])
    longer = render({"stages": {"thinker": {"initTimeoutS": 3600}}})
    thinker, _ = containers(longer)["thinker"]
    assert thinker["startupProbe"]["failureThreshold"] == 720
    off = containers(render({"probes": {"enabled": False}}))
    assert not any("livenessProbe" in c for c, _ in off.values())


def test_tls_secret_and_otlp_endpoint_reach_every_container() -> None:
    docs = render(TLS)
    for name, (container, spec) in containers(docs).items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
        assert env["OMNI_TLS_CERT"] == "/etc/omni/tls/tls.crt", name
        assert env["OMNI_TLS_CA"] == "/etc/omni/tls/ca.crt", name
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["tls"]["mountPath"] == "/etc/omni/tls" and mounts["tls"]["readOnly"]
        (tls,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert tls["secret"]["secretName"] == "omni-tls"
        # Tokens: every container has the mesh token; only the orchestrator the
        # client tokens (a stage's volume projects the mesh-token key alone).
        assert env["OMNI_MESH_TOKEN_FILE"] == "/etc/omni/auth/mesh-token", name
        assert mounts["auth"]["mountPath"] == "/etc/omni/auth" and mounts["auth"]["readOnly"]
        (auth,) = [v for v in spec["volumes"] if v["name"] == "auth"]
        assert auth["secret"]["secretName"] == "omni-auth"
        if name == "orchestrator":
            assert env["OMNI_TOKENS_FILE"] == "/etc/omni/auth/tokens.yaml"
            assert "items" not in auth["secret"]
        else:
            assert "OMNI_TOKENS_FILE" not in env, name
            assert auth["secret"]["items"] == [{"key": "mesh-token", "path": "mesh-token"}]
    for container, _ in containers(render()).values():
        assert not any(
            e["name"].startswith(("OMNI_TLS", "OTEL", "OMNI_TOKENS")) for e in container["env"]
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_are_hardened(variant: str) -> None:
    docs = render(VARIANTS[variant])
    for name, spec in pod_specs(docs).items():
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["capabilities"] == {"drop": ["ALL"]}, (name, container["name"])


def test_network_policy_lets_only_the_orchestrator_reach_stages() -> None:
    docs = render(GROUP)
    policy = by_kind(docs, "NetworkPolicy")["omni-stages"]["spec"]
    for deployment in by_kind(docs, "Deployment").values():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selected = policy["podSelector"]["matchLabels"].items() <= labels.items()
        is_stage = labels["app.kubernetes.io/component"] == "stage"
        assert selected == is_stage, deployment["metadata"]["name"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    orchestrator = by_kind(docs, "Deployment")["omni-orchestrator"]
    assert (
        peer["podSelector"]["matchLabels"] == orchestrator["spec"]["template"]["metadata"]["labels"]
    )
    assert sorted(p["port"] for p in rule["ports"]) == [50051, 50052]


def test_podman_values_render_only_what_podman_kube_play_runs() -> None:
    docs = render(VARIANTS["podman"])
    assert {d["kind"] for d in docs} <= {"Deployment", "ConfigMap", "PersistentVolumeClaim"}
    pipeline = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    ports = set()
    for name, (container, spec) in containers(docs).items():
        assert spec["hostNetwork"] is True
        assert container["image"] == "localhost/omni:cpu"
        assert container["imagePullPolicy"] == "Never"
        port = int(flag(container, "--port"))
        ports.add(port)
        if name != "orchestrator":
            assert pipeline.stage(name).address == f"127.0.0.1:{port}"
    assert len(ports) == 3  # one host network: every service its own port


# --- refusals ---------------------------------------------------------------------


def test_the_readme_example_values_render_valid_stage_files() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Deploy on Kubernetes", 1)[1]
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    docs = render(example)
    specs = pod_specs(docs)
    assert [c["name"] for c in specs["omni-voice"]["containers"]] == ["decoder", "talker"]
    pipeline = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    assert pipeline.entry == "thinker"
    for name in pipeline.names:
        stage_file = config_file(docs, "omni-stages", f"{name}.yaml")
        parse_stage_config(stage_file, name)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
