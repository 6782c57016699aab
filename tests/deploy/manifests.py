"""What the chart tests render and how they read it back: the values variants
(GPU, groups, replicas, TLS, podman) and lookups into the rendered manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.deploy.chart import CHART_DIR, load_values

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
