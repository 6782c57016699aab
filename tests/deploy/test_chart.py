"""charts/ rendered with real Helm (the Helm v4 Go SDK through helm-python-sdk,
offline): lint clean, every manifest valid for Kubernetes 1.29 and 1.33, and the
defaults, the podman values and docs/deployment.md's example rendering what they promise.
Wiring is checked in test_chart_wiring.py, hardening in test_chart_security.py."""

from __future__ import annotations

import helm_python
import kubernetes_validate
import pytest
import yaml

from orchestrator.server.pipeline import load_pipeline, parse_pipeline
from services.stage.config import parse_stage_config
from tests.deploy.chart import CHART_DIR, render
from tests.deploy.manifests import (
    KUBE_VERSIONS,
    REPO,
    VARIANTS,
    by_kind,
    config_file,
    containers,
    flag,
    pod_specs,
)


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
    names = {
        "omni-orchestrator",
        "omni-thinker",
        "omni-renderer",
        "omni-speaker",
        "omni-recogniser",
    }
    assert set(by_kind(docs, "Deployment")) == names
    assert set(by_kind(docs, "Service")) == names | {"omni-orchestrator-peers"}
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
        assert rendered.stage(stage.name).alone == stage.alone


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
    assert len(ports) == 5  # one host network: every service its own port


def test_the_documented_example_values_render_valid_stage_files() -> None:
    doc = (REPO / "docs" / "deployment.md").read_text()
    section = doc.split("\n## Deploy on Kubernetes\n", 1)[1]
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
