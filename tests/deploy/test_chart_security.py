"""The rendered chart's security: TLS, tokens and the OTLP endpoint reach every
container (and only the orchestrator gets client tokens), pods are hardened, and
only the orchestrator may reach the stages."""

from __future__ import annotations

import pytest

from tests.deploy.chart import merge, render
from tests.deploy.manifests import GROUP, TLS, VARIANTS, by_kind, containers, pod_specs


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
        # Only the orchestrator holds an API token: its own account's, to watch the
        # stages' Pods (test_chart_rbac.py), unless there is no cluster to ask.
        watches = name == "omni-orchestrator" and not VARIANTS[variant].get("hostNetwork")
        assert spec["automountServiceAccountToken"] is watches, name
        assert spec.get("serviceAccountName") == ("omni-orchestrator" if watches else None)
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
    rule, data = policy["ingress"]
    (peer,) = rule["from"]
    orchestrator = by_kind(docs, "Deployment")["omni-orchestrator"]
    assert (
        peer["podSelector"]["matchLabels"] == orchestrator["spec"]["template"]["metadata"]["labels"]
    )
    assert sorted(p["port"] for p in rule["ports"]) == [50051, 50052, 50055, 50056]
    # Data ports: any Pod of the release (a stage on another node pulls from them).
    (release,) = data["from"]
    assert (
        release["podSelector"]["matchLabels"].items() <= peer["podSelector"]["matchLabels"].items()
    )
    assert "app.kubernetes.io/component" not in release["podSelector"]["matchLabels"]
    assert sorted(p["port"] for p in data["ports"]) == [52051, 52052, 52055, 52056]
    # Under TLS the stages open no data port: neither the rule nor the port is there.
    tls = render(merge(GROUP, TLS))
    (only,) = by_kind(tls, "NetworkPolicy")["omni-stages"]["spec"]["ingress"]
    assert only["from"] == rule["from"]
    for deployment in by_kind(tls, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert not any(p["name"].startswith("data-") for p in container.get("ports", []))
