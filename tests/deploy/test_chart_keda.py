"""KEDA in the chart (keda.stages): a ScaledObject per stage listed, scaling that
stage's own Deployment through the orchestrator's external scaler, rendered with
real Helm: lint clean, the core kinds valid for Kubernetes 1.29 and 1.33, KEDA's
kinds valid against the fields KEDA documents (no KEDA CRD schema ships with
kubernetes-validate), and the trigger's metadata read back by the orchestrator's
own parser (orchestrator/server/scaling/trigger.py) as the stage and target intended."""

from __future__ import annotations

from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.scaling.trigger import read_trigger
from tests.deploy.chart import CHART_DIR, merge, render
from tests.deploy.manifests import (
    GROUP,
    KUBE_VERSIONS,
    REPO,
    TLS,
    VARIANTS,
    by_kind,
    config_file,
)

KEDA = {
    "keda": {
        "stages": {
            "thinker": {"maxReplicaCount": 4},
            "speaker": {"minReplicaCount": 2, "maxReplicaCount": 6, "targetPerReplica": 2.5},
        }
    }
}
WITH_KEDA = {"defaults": KEDA, "tls": merge(TLS, KEDA)}
KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")

# What KEDA documents of the two kinds (keda.sh/docs: "ScaledObject specification",
# "External" scaler, "TriggerAuthentication"), as far as the chart writes them; a
# field KEDA does not know is refused as the API server's CRD schema would prune it.
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": {"type": "object"}},
}
SCHEMAS = {
    "ScaledObject": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": {"type": "string"},
                            "envSourceContainerName": {"type": "string"},
                        },
                    },
                    "pollingInterval": _INT32,
                    "cooldownPeriod": _INT32,
                    "idleReplicaCount": _INT32,
                    "minReplicaCount": _INT32,
                    "maxReplicaCount": _INT32,
                    "advanced": {"type": "object"},
                    "fallback": {"type": "object"},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "additionalProperties": False,
                            "properties": {
                                "type": {"type": "string"},
                                "name": {"type": "string"},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "metadata": {
                                    "type": "object",
                                    "additionalProperties": {"type": "string"},
                                },
                                "authenticationRef": {
                                    "type": "object",
                                    "required": ["name"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "name": {"type": "string"},
                                        "kind": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    "TriggerAuthentication": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "TriggerAuthentication"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "secretTargetRef": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["parameter", "name", "key"],
                            "additionalProperties": False,
                            "properties": {
                                "parameter": {"type": "string"},
                                "name": {"type": "string"},
                                "key": {"type": "string"},
                            },
                        },
                    }
                },
            },
        },
    },
}
HPA_WINDOW = {"type": "integer", "minimum": 0, "maximum": 3600}  # HPA's own bound


@pytest.mark.parametrize("variant", WITH_KEDA)
def test_it_renders_lint_clean_and_valid(variant: str) -> None:
    values = WITH_KEDA[variant]
    for kube in KUBE_VERSIONS:
        report = helm_python.lint(CHART_DIR, values, strict=True, kube_version=f"v{kube}")
        assert report["errors"] == [] and all(m["severity"] == 1 for m in report["messages"])
    docs = render(values)
    kinds = [d["kind"] for d in docs if d["kind"] in KEDA_KINDS]
    assert kinds.count("ScaledObject") == 2
    assert kinds.count("TriggerAuthentication") == (variant == "tls")
    for doc in docs:
        if doc["kind"] in KEDA_KINDS:
            jsonschema.validate(doc, SCHEMAS[doc["kind"]])
            if doc["kind"] == "ScaledObject":
                behavior = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
                jsonschema.validate(behavior["scaleDown"]["stabilizationWindowSeconds"], HPA_WINDOW)
            continue
        for kube in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, kube, strict=True)


def test_the_schema_check_refuses_a_field_keda_does_not_have() -> None:
    (scaled, *_rest) = by_kind(render(KEDA), "ScaledObject").values()
    scaled["spec"]["triggers"][0]["metadata"]["targetPerReplica"] = 4  # not a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCHEMAS["ScaledObject"])
    scaled["spec"]["triggers"][0]["metadata"]["targetPerReplica"] = "4"
    scaled["spec"]["minReplicas"] = 1  # the HPA's word, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCHEMAS["ScaledObject"])


def test_off_by_default() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] in KEDA_KINDS]
    for deployment in by_kind(docs, "Deployment").values():
        assert deployment["spec"]["replicas"] >= 1  # each keeps its own: no HPA owns it
    assert not [d for n, d in VARIANTS.items() for d in render(d) if d["kind"] in KEDA_KINDS]


def test_each_scales_its_stage_on_what_the_orchestrator_reads_from_its_trigger() -> None:
    docs = render(KEDA)
    deployments = by_kind(docs, "Deployment")
    orchestrator = by_kind(docs, "Service")["omni-orchestrator"]
    (grpc_port,) = orchestrator["spec"]["ports"]
    container = deployments["omni-orchestrator"]["spec"]["template"]["spec"]["containers"][0]
    served = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert served[grpc_port["targetPort"]] == grpc_port["port"]  # the port the scaler is on
    pipeline = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    found = {}
    for name, scaled in by_kind(docs, "ScaledObject").items():
        spec = scaled["spec"]
        target = spec["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        assert target["name"] == name and name in deployments
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "external" and "authenticationRef" not in trigger
        metadata = trigger["metadata"]
        assert metadata["scalerAddress"] == (
            f"omni-orchestrator.default.svc.cluster.local:{grpc_port['port']}"
        )
        read = read_trigger(metadata, pipeline.names, needs_target=True)
        # The Deployment scaled runs the stage the orchestrator counts for it.
        pod = deployments[name]["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == [read.stage]
        assert "replicas" not in deployments[name]["spec"]  # the HPA's, kept on upgrade
        found[read.stage] = (spec["minReplicaCount"], spec["maxReplicaCount"], read.target)
    # The thinker's target defaults to what it runs at once (its max_batch_size: 4).
    assert found == {"thinker": (1, 4, 4.0), "speaker": (2, 6, 2.5)}
    assert deployments["omni-renderer"]["spec"]["replicas"] == 1  # not listed: unchanged


def test_with_tls_keda_verifies_the_orchestrator_with_the_mesh_ca() -> None:
    docs = render(merge(TLS, KEDA))
    (auth,) = by_kind(docs, "TriggerAuthentication").values()
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "caCert", "name": "omni-tls", "key": "ca.crt"}
    ]
    for scaled in by_kind(docs, "ScaledObject").values():
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}


def scaled(**stage: Any) -> dict[str, Any]:
    return {"keda": {"stages": {"thinker": {"maxReplicaCount": 4, **stage}}}}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (scaled(minReplicaCount=0), "/keda/stages/thinker/minReplicaCount"),
        ({"keda": {"stages": {"thinker": {}}}}, "maxReplicaCount"),
        (scaled(targetPerReplica=0), "/keda/stages/thinker/targetPerReplica"),
        (scaled(cooldownPeriod=30), "'cooldownPeriod'"),
        ({"keda": {"scaleDownStabilizationSeconds": 7200}}, "/keda/scaleDownStabilizationSeconds"),
        (scaled(minReplicaCount=5), "keda.stages.thinker.maxReplicaCount: 4 is below"),
        ({"keda": {"stages": {"talker": {"maxReplicaCount": 2}}}}, "keda.stages.talker: unknown"),
        (merge(GROUP, scaled()), "keda.stages.thinker: stage thinker runs in the Pod of group"),
        (merge({"stages": {"thinker": {"replicas": 2}}}, scaled()), "stages.thinker.replicas"),
        (merge(VARIANTS["podman"], scaled()), "keda.stages: KEDA dials the orchestrator's"),
    ],
)
def test_bad_keda_values_are_refused_naming_the_value(values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm_python.HelmError) as refused:
        render(values)
    assert named in str(refused.value)


def test_the_documented_example_renders_what_the_docs_say() -> None:
    doc = (REPO / "docs" / "deployment.md").read_text()
    section = doc.split("\n### A stage that grows with its queue (KEDA)\n", 1)[1]
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    (scaled,) = by_kind(render(example), "ScaledObject").values()
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["stage"] == "thinker"
    assert trigger["metadata"]["targetPerReplica"] == "4"
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 8)
    assert scaled["spec"]["pollingInterval"] == 15
