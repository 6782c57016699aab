"""The orchestrator's access to the Kubernetes API (charts/templates/rbac.yaml): its
own ServiceAccount bound to a Role that lists and watches pods in the release's
namespace and nothing more, and each stage's ``pods`` selector in the pipeline
selecting exactly its own Deployment's Pods. That the Role suffices and refuses
the rest is shown against a real API server in tests/deploy/kube."""

from __future__ import annotations

import pytest

from tests.deploy.chart import load_values, render
from tests.deploy.manifests import GROUP, PODMAN_VALUES, VARIANTS, by_kind, config_file

ROLE_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def selects(selector: str, labels: dict[str, str]) -> bool:
    pairs = dict(pair.split("=", 1) for pair in selector.split(","))
    return all(labels.get(key) == value for key, value in pairs.items())


def test_the_role_lists_and_watches_pods_in_its_namespace_only() -> None:
    docs = render(namespace="omni-ns")
    (role,) = by_kind(docs, "Role").values()
    assert role["metadata"]["name"] == "omni-orchestrator"
    assert role["rules"] == ROLE_RULES
    assert "namespace" not in role["metadata"]  # the release's, as every object here
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    (binding,) = by_kind(docs, "RoleBinding").values()
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "omni-orchestrator",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "omni-orchestrator", "namespace": "omni-ns"}
    ]
    (account,) = by_kind(docs, "ServiceAccount").values()
    assert account["metadata"]["name"] == "omni-orchestrator"
    assert account["automountServiceAccountToken"] is False  # the Pod asks for it
    orchestrator = by_kind(docs, "Deployment")["omni-orchestrator"]["spec"]["template"]["spec"]
    assert orchestrator["serviceAccountName"] == "omni-orchestrator"
    assert orchestrator["automountServiceAccountToken"] is True


@pytest.mark.parametrize("variant", ["defaults", "group", "replicas"])
def test_each_stage_watches_exactly_its_own_deployments_pods(variant: str) -> None:
    docs = render(VARIANTS[variant])
    pipeline = config_file(docs, "omni-pipeline", "pipeline.yaml")
    deployments = by_kind(docs, "Deployment")
    for stage in pipeline["stages"]:
        unit = (VARIANTS[variant].get("stages", {}).get(stage["name"]) or {}).get("group")
        owner = f"omni-{unit or stage['name']}"
        chosen = [
            name
            for name, d in deployments.items()
            if selects(stage["pods"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert chosen == [owner], (stage["name"], stage["pods"])
        # The address stays the stage's headless Service: its port is the Pods',
        # its name the fallback where the API cannot be asked.
        service = f"omni-{stage['name']}.default.svc.cluster.local"
        assert stage["address"].startswith(f"dns:///{service}:")


@pytest.mark.parametrize(
    "values", [{"podWatch": {"enabled": False}}, load_values(PODMAN_VALUES)], ids=["off", "podman"]
)
def test_without_the_pod_watch_there_is_no_account_and_stages_go_by_address(
    values: dict[str, object],
) -> None:
    docs = render(values)
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert not by_kind(docs, kind), kind
    pipeline = config_file(docs, "omni-pipeline", "pipeline.yaml")
    assert all("pods" not in stage for stage in pipeline["stages"])
    spec = by_kind(docs, "Deployment")["omni-orchestrator"]["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec


def test_a_grouped_stage_watches_its_groups_pods() -> None:
    pipeline = config_file(render(GROUP), "omni-pipeline", "pipeline.yaml")
    pods = {s["name"]: s["pods"] for s in pipeline["stages"]}
    assert pods["thinker"] == pods["renderer"]
    assert "omni-mesh.dev/unit=pair" in pods["thinker"]
