"""Fixtures of the container tests (owner: containers/)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers import podman

RESULTS = podman.REPO / "benchmarks" / "results"


@pytest.fixture(scope="session")
def cpu_image(tmp_path_factory: pytest.TempPathFactory) -> podman.Image:
    """The CPU image of this tree (built when its inputs changed, else reused)."""
    podman.require()
    return _announced("container image", podman.cpu_image(tmp_path_factory.mktemp("image")))


@pytest.fixture(scope="session")
def vllm_cpu_image(
    cpu_image: podman.Image, tmp_path_factory: pytest.TempPathFactory
) -> podman.Image:
    """The vLLM-on-CPU image over this tree's CPU image (built when either changed)."""
    image = podman.vllm_cpu_image(cpu_image, tmp_path_factory.mktemp("vllm-image"))
    return _announced("vllm-cpu image", image)


def _announced(what: str, image: podman.Image) -> podman.Image:
    figures = {
        "image": image.ref,
        "size_mb": round(image.size_bytes / 1e6),
        "build_s": image.build_s,
    }
    print(f"\n{what}: {json.dumps(figures)}")
    return image


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, object]]:
    """Timings the container tests measured, written to benchmarks/results/containers.json."""
    measured: dict[str, object] = {}
    yield measured
    if measured:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path: Path = RESULTS / "containers.json"
        path.write_text(json.dumps(measured, indent=2) + "\n")
