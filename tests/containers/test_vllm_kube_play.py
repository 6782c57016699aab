"""The vLLM-on-CPU image under `podman kube play`: the chart rendered for one
stage, a vllm thinker (examples/stages/vllm-cpu.yaml's settings) on that image,
answers through the orchestrator Pod (on the CPU image)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.client import AsyncClient
from tests.containers import podman
from tests.containers.test_kube_play import PODMAN_VALUES, _free_ports
from tests.deploy.chart import load_values, merge, render
from tests.helpers.grpcurl import grpcurl, json_stream
from tests.helpers.reference_answer import ReferenceLM

pytestmark = [pytest.mark.container, pytest.mark.timeout(2400)]

EXAMPLE = podman.REPO / "examples" / "stages" / "vllm-cpu.yaml"
RELEASE = "omni-vllm-ci"


def _manifests(cpu: str, vllm: str, tmp_path: Path, dev_shm: Path) -> tuple[Path, dict[str, int]]:
    example = yaml.safe_load(EXAMPLE.read_text())
    orchestrator, thinker = _free_ports(2)
    repository, tag = cpu.rsplit(":", 1)
    vllm_repository, vllm_tag = vllm.rsplit(":", 1)
    values = merge(
        load_values(PODMAN_VALUES),
        {
            "image": {"repository": repository, "tag": tag},
            "orchestrator": {"port": orchestrator},
            "pipeline": {"name": "omni-vllm", "edges": [], "outputs": ["thinker"]},
            "stages": {
                "renderer": None,  # Helm drops a key set to null
                "speaker": None,
                "recogniser": None,
                "thinker": {
                    "engine": "vllm",
                    "model": example["model"],
                    "image": {"repository": vllm_repository, "tag": vllm_tag},
                    "port": thinker,
                    "initTimeoutS": 900,
                    "settings": {
                        "dtype": example["dtype"],
                        "engine_args": example["engine_args"],
                        "runtime": {"max_batch_size": 4, "max_prompt_tokens": 2048},
                    },
                    "resources": {"limits": {"memory": "8Gi"}},
                },
            },
        },
    )
    docs = [
        _podman_dev_shm(doc, dev_shm)
        for doc in podman.podman_compatible(render(values, name=RELEASE))
    ]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path, {"orchestrator": orchestrator, "thinker": thinker}


def _podman_dev_shm(doc: dict[str, Any], dev_shm: Path) -> dict[str, Any]:
    """The chart's Memory emptyDir at /dev/shm made a host folder on the host's
    tmpfs: podman 4.3 mounts that emptyDir owned by root, mode 0755 (Kubernetes
    makes emptyDirs world-writable), so vLLM, as uid 10001, could not create its
    shared-memory queues there, and podman's own /dev/shm is 64 MiB where vLLM
    wants 160. A folder of this test's own (``dev_shm``, mode 1777) rather than the
    host's /dev/shm itself: vLLM leaves its queues (160-250 MB each) behind when
    its pod is stopped, which Kubernetes' emptyDir would drop with the pod, and so
    does removing the folder here."""
    if doc["kind"] == "Deployment":
        for volume in doc["spec"]["template"]["spec"]["volumes"]:
            if volume["name"] == "dshm":
                volume.pop("emptyDir")
                volume["hostPath"] = {"path": str(dev_shm), "type": "Directory"}
    return doc


@pytest.fixture
def dev_shm() -> Iterator[Path]:
    """A fresh world-writable folder on the host's /dev/shm, removed with all
    that the pod left in it."""
    path = Path(tempfile.mkdtemp(prefix="omni-vllm-ci-", dir="/dev/shm"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_a_vllm_stage_answers_from_its_image_under_podman(
    cpu_image: podman.Image,
    vllm_cpu_image: podman.Image,
    figures: dict[str, object],
    tmp_path: Path,
    dev_shm: Path,
    smollm2_reference: ReferenceLM,
) -> None:
    manifests, ports = _manifests(cpu_image.ref, vllm_cpu_image.ref, tmp_path, dev_shm)
    with podman.machine_lock():
        began = time.monotonic()
        with podman.kube_played(manifests) as pods:
            units = sorted(pod.removeprefix(f"{RELEASE}-").split("-pod")[0] for pod in pods)
            assert units == ["orchestrator", "thinker"], pods
            async with AsyncClient(f"127.0.0.1:{ports['orchestrator']}") as client:
                await client.wait_ready(timeout_s=1200)
                ready_s = time.monotonic() - began
                result = await client.generate(
                    "What is the capital of France?", params={"max_tokens": 12}
                ).collect()
            stage = f"127.0.0.1:{ports['thinker']}"
            events = json_stream(
                await asyncio.to_thread(grpcurl, stage, "omni.v1.Stage/InitStatus")
            )
    assert result.ok, result.done
    # The example runs float32 on a CPU (docs/engines.md): what plain transformers'
    # float32 says on this machine, up to a near-tie.
    said = smollm2_reference.answer("What is the capital of France?", 12)
    said.assert_said(result.stages["thinker"].token_ids)
    planned = next(e for e in events if e["phase"] == "MEMORY_PLANNED")
    assert "vLLM" in next(e for e in events if e["phase"] == "LOAD_DONE")["message"]
    # vLLM's CPU blocks (128 tokens), its own cache (grpcurl keeps the proto's names).
    assert int(planned["memory"]["page_size"]) == 128, planned
    figures.update(
        vllm_image=vllm_cpu_image.ref,
        vllm_image_size_mb=round(vllm_cpu_image.size_bytes / 1e6),
        vllm_image_build_s=None
        if vllm_cpu_image.build_s is None
        else round(vllm_cpu_image.build_s, 1),
        vllm_kube_play_to_ready_s=round(ready_s, 1),
    )
    print(f"\nvllm stage: kube play to READY {ready_s:.1f}s")
