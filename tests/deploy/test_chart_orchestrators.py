"""Issue 39, item 5, in the chart: two orchestrators by default, a disruption budget
that keeps one serving, and a headless peers Service each orchestrator is told of
(--peers) so an Abort, a Pause or a Resume reaches them all."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.server.stages.resolver import Target
from tests.deploy.chart import merge, render
from tests.deploy.manifests import VARIANTS, by_kind, flag, pod_of


def orchestrator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = by_kind(docs, "Deployment")["omni-orchestrator"]["spec"]["template"]["spec"][
        "containers"
    ]
    return container


def test_two_orchestrators_a_budget_and_peers_by_default() -> None:
    docs = render(namespace="mesh")
    deployment = by_kind(docs, "Deployment")["omni-orchestrator"]
    assert deployment["spec"]["replicas"] == 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (budget,) = by_kind(docs, "PodDisruptionBudget").values()
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # The peers Service: headless, every orchestrator Pod (not-ready ones hold requests too).
    peers = by_kind(docs, "Service")["omni-orchestrator-peers"]
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    assert pod_of(docs, peers) is deployment
    # Each orchestrator is told of that Service's name, at the port the orchestrators serve.
    target = Target.parse(flag(orchestrator_container(docs), "--peers"))
    assert target.host == "omni-orchestrator-peers.mesh.svc.cluster.local"
    assert target.port == peers["spec"]["ports"][0]["port"] == 50050
    # Clients keep the one Service; it selects both orchestrators.
    assert pod_of(docs, by_kind(docs, "Service")["omni-orchestrator"]) is deployment


@pytest.mark.parametrize(
    "values",
    [
        {"orchestrator": {"replicas": 1}},
        {"orchestrator": {"podDisruptionBudget": {"enabled": False}}},
        VARIANTS["podman"],
    ],
    ids=["one orchestrator", "budget off", "podman"],
)
def test_no_budget_where_it_cannot_hold(values: dict[str, Any]) -> None:
    docs = render(merge({}, values))
    assert not by_kind(docs, "PodDisruptionBudget")


def test_podman_runs_one_orchestrator_without_peers() -> None:
    docs = render(VARIANTS["podman"])
    assert by_kind(docs, "Deployment")["omni-orchestrator"]["spec"]["replicas"] == 1
    assert "--peers" not in orchestrator_container(docs)["args"]
