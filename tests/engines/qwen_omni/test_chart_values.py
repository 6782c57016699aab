"""charts/ci/qwen3-omni-values.yaml, rendered with real Helm: lint clean, valid for
Kubernetes, the three stages as containers of one Pod with their GPUs, the model
cache a claim, and stage files that the stage itself accepts."""

from __future__ import annotations

import helm_python
import kubernetes_validate

from orchestrator.server.pipeline import parse_pipeline
from services.stage.config import parse_stage_config
from tests.deploy.chart import CHART_DIR, load_values, render
from tests.deploy.manifests import KUBE_VERSIONS, by_kind, config_file, pod_specs

VALUES = load_values(CHART_DIR / "ci" / "qwen3-omni-values.yaml")
STAGES = {"thinker": "thinker", "talker": "talker", "code2wav": "code2wav"}


def test_lint_clean_and_valid_for_kubernetes() -> None:
    for kube in KUBE_VERSIONS:
        report = helm_python.lint(CHART_DIR, VALUES, strict=True, kube_version=f"v{kube}")
        assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] != 1]
        for doc in render(VALUES):
            kubernetes_validate.validate(doc, kube, strict=True)


def test_three_stages_in_one_pod_with_their_gpus_and_valid_stage_files() -> None:
    docs = render(VALUES)
    specs = pod_specs(docs)
    assert [c["name"] for c in specs["omni-omni"]["containers"]] == sorted(STAGES)
    assert set(specs) == {"omni-omni", "omni-orchestrator"}  # the defaults' stages dropped
    pod = specs["omni-omni"]
    gpus = {c["name"]: c["resources"]["limits"]["nvidia.com/gpu"] for c in pod["containers"]}
    assert gpus == {"code2wav": 1, "talker": 1, "thinker": 1}
    assert pod["shareProcessNamespace"] is True  # CUDA IPC between them
    claims = by_kind(docs, "PersistentVolumeClaim")
    assert list(claims) == ["omni-model-cache"]
    pipeline = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    assert pipeline.entry == "thinker" and set(pipeline.names) == set(STAGES)
    assert pipeline.watchdog.paused_phases == {"download"}  # the download is not counted
    for name in STAGES:
        stage = parse_stage_config(config_file(docs, "omni-stages", f"{name}.yaml"), name)
        assert stage.engine == f"qwen_omni_{name}"
        assert stage.runtime.device == "cuda"
        assert stage.model == "hf://Qwen/Qwen3-Omni-30B-A3B-Instruct"
