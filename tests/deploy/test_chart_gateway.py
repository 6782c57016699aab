"""The gateway in the chart (gateway.enabled): its own Deployment and Service,
rendered with real Helm and valid for Kubernetes 1.29 and 1.33, dialling the
orchestrator's Service (over TLS with the mesh CA alone), probed over HTTP."""

from __future__ import annotations

from typing import Any

import helm_python
import kubernetes_validate
import pytest

from tests.deploy.chart import CHART_DIR, merge, render
from tests.deploy.manifests import KUBE_VERSIONS, TLS, VARIANTS, by_kind, containers, flag

GATEWAY = {"gateway": {"enabled": True, "port": 8080}}
WITH_GATEWAY = {
    "defaults": GATEWAY,
    "tls": merge(TLS, GATEWAY),
    "podman": merge(VARIANTS["podman"], {"gateway": {"enabled": True, "port": 58080}}),
}


@pytest.mark.parametrize("variant", WITH_GATEWAY)
def test_the_gateway_renders_valid_and_lint_clean(variant: str) -> None:
    values = WITH_GATEWAY[variant]
    for kube in KUBE_VERSIONS:
        report = helm_python.lint(CHART_DIR, values, strict=True, kube_version=f"v{kube}")
        assert report["errors"] == [] and all(m["severity"] == 1 for m in report["messages"])
    for doc in render(values):
        for kube in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, kube, strict=True)


def test_off_by_default() -> None:
    docs = render()
    assert "omni-gateway" not in by_kind(docs, "Deployment")
    assert "omni-gateway" not in by_kind(docs, "Service")


def test_it_dials_the_orchestrators_service_and_is_served_by_its_own() -> None:
    docs = render(GATEWAY)
    gateway, _spec = containers(docs)["gateway"]
    assert gateway["command"] == ["omni"] and gateway["args"][0] == "gateway"
    orchestrator = by_kind(docs, "Service")["omni-orchestrator"]
    port = orchestrator["spec"]["ports"][0]["port"]
    assert flag(gateway, "--orchestrator") == f"omni-orchestrator.default.svc.cluster.local:{port}"
    assert (flag(gateway, "--host"), flag(gateway, "--port")) == ("0.0.0.0", "8080")
    assert "--cacert" not in gateway["args"]
    assert (flag(gateway, "--max-connections"), flag(gateway, "--backlog")) == ("512", "2048")
    assert flag(gateway, "--max-sessions") == "100"  # /v1/realtime sessions at once
    service = by_kind(docs, "Service")["omni-gateway"]
    assert service["spec"]["ports"] == [
        {
            "name": "http",
            "port": 8080,
            "targetPort": "http",
            "protocol": "TCP",
            "appProtocol": "http",
        }
    ]
    deployment = by_kind(docs, "Deployment")["omni-gateway"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert gateway["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # The stages' NetworkPolicy still admits the orchestrator alone to their gRPC ports.
    policy = by_kind(docs, "NetworkPolicy")["omni-stages"]
    rule, _data = policy["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "orchestrator"
    )


def test_with_tls_it_verifies_the_orchestrator_with_the_ca_alone() -> None:
    docs = render(merge(TLS, GATEWAY))
    gateway, spec = containers(docs)["gateway"]
    assert flag(gateway, "--cacert") == "/etc/omni/tls/ca.crt"
    (tls,) = [v for v in spec["volumes"] if v["name"] == "tls"]
    assert tls["secret"] == {
        "secretName": "omni-tls",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    assert not [e for e in gateway["env"] if e["name"].startswith("OMNI_TLS")]


def test_on_the_host_network_it_dials_loopback() -> None:
    docs = render(WITH_GATEWAY["podman"])
    gateway, spec = containers(docs)["gateway"]
    assert spec["hostNetwork"] is True
    assert flag(gateway, "--orchestrator") == "127.0.0.1:58050"
    assert "Service" not in {d["kind"] for d in docs}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"gateway": {"enabled": True, "port": 50051}}, "gateway.port: 50051 is already taken"),
        ({"gateway": {"enabled": True, "port": 51050}}, "the orchestrator's health port"),
        (
            {
                "gateway": {"enabled": True},
                "stages": {"gateway": {"engine": "vllm", "port": 50070}},
            },
            "stages.gateway: with gateway.enabled",
        ),
        ({"gateway": {"port": 0}}, "/gateway/port"),
        ({"gateway": {"tls": True}}, "'tls'"),
        ({"gateway": {"maxConnections": 0}}, "/gateway/maxConnections"),
        ({"gateway": {"maxSessions": 0}}, "/gateway/maxSessions"),
    ],
)
def test_bad_gateway_values_are_refused_naming_the_value(
    values: dict[str, Any], named: str
) -> None:
    with pytest.raises(helm_python.HelmError) as refused:
        render(values)
    assert named in str(refused.value)
