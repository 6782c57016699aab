"""The rendered mesh wired as the values say, read back from the manifests a
cluster would receive: stage addresses, groups, replicas, GPUs and probes."""

from __future__ import annotations

import math

import helm_python
import pytest
import yaml

from orchestrator.server.pipeline import parse_pipeline
from services.stage.config import parse_stage_config
from tests.deploy.chart import CHART_DIR, merge, render
from tests.deploy.manifests import (
    GPU,
    GROUP,
    REPLICAS,
    VARIANTS,
    by_kind,
    config_file,
    containers,
    flag,
    pod_of,
    pod_specs,
)


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
        # The gRPC port, the plaintext health-only port the probes dial, and the
        # data port stages on other nodes pull large tensors from.
        health, data = str(int(port) + 1000), str(int(port) + 2000)
        ports = [p["containerPort"] for p in container["ports"]]
        assert ports == [int(port), int(health), int(data)]
        assert flag(container, "--port") == port and flag(container, "--host") == "0.0.0.0"
        assert flag(container, "--health-port") == health and flag(container, "--data-port") == data
        advertised = {e["name"]: e for e in container["env"]}["OMNI_ADVERTISE_HOST"]
        assert advertised["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert flag(container, "--config") == f"/etc/omni/stages/{stage.name}.yaml"
        # The stage file it reads is valid for the stage service itself.
        parse_stage_config(yaml.safe_load(stage_files[f"{stage.name}.yaml"]), stage.name)
    (orchestrator,) = pod_specs(docs)["omni-orchestrator"]["containers"]
    assert flag(orchestrator, "--pipeline") == "/etc/omni/pipeline/pipeline.yaml"


def test_grouped_stages_share_one_pod_and_its_shm() -> None:
    docs = render(GROUP)
    specs = pod_specs(docs)
    # speaker and recogniser: Pods of their own
    assert set(specs) == {"omni-orchestrator", "omni-pair", "omni-speaker", "omni-recogniser"}
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
    assert deployments["omni-orchestrator"]["spec"]["replicas"] == 2
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
