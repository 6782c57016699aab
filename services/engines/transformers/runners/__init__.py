"""The model runners of the transformers engine, one per model family, and the one
place that chooses which runs a model (and so which forward it runs):

- ``llama_cpu.py``: Llama-shaped decoders on GGUF blocks on the CPU: decode steps
  through the kernels' decode stack, prefills and mixed steps through the lean
  forward (lean.py);
- ``reference.py``: any causal LM, through transformers' own forward.

Both keep their rows as text_runner.py does, under the shared scheduler
(services/engines/scheduler).
"""

from __future__ import annotations

import logging
from typing import Literal

from transformers import PreTrainedModel

from services.engines.transformers.runners.kv_budget import KvBudget
from services.engines.transformers.runners.llama_cpu import LlamaCpuRunner, llama_cpu_refuses
from services.engines.transformers.runners.reference import ReferenceRunner
from services.engines.transformers.runners.text_runner import TextRunner

logger = logging.getLogger(__name__)

RunnerChoice = Literal["auto", "reference"]


def runner_for(
    model: PreTrainedModel, budget: KvBudget | None, choice: RunnerChoice = "auto"
) -> TextRunner:
    """The fastest runner that takes ``model`` (``reference``: transformers' forward)."""
    if choice == "auto":
        why = llama_cpu_refuses(model)
        if why is None:
            return LlamaCpuRunner(model, budget)
        logger.debug("the llama_cpu runner does not take this model: %s", why)
    return ReferenceRunner(model, budget)


def runner_name(runner: TextRunner) -> str:
    return "llama_cpu" if isinstance(runner, LlamaCpuRunner) else "reference"


__all__ = ["KvBudget", "RunnerChoice", "TextRunner", "runner_for", "runner_name"]
