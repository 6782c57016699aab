"""Plain vLLM (its ``LLM`` class, none of our code) on a model folder, as the
reference the vllm engine's tests and benchmark compare with. Run as a process
(vLLM spawns its own, and exiting frees its memory before the next engine starts):

    python -m tests.helpers.plain_vllm FOLDER OUT < {"prompts": [[ids], ...], "max_tokens": N,
                                                     "dtype": "float32"}

writes {"token_ids": [[ids], ...], "texts": [...]} to OUT (vLLM logs on stdout):
greedy, one prompt at a time.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# The engine under test runs with exactly these (services.engines.vllm.config.CpuArgs),
# in the dtype it is asked for (the CPU example's: tests/vllm/cpu/conftest.py).
SETTINGS: dict[str, Any] = {"max_model_len": 2048, "enforce_eager": True}


def main() -> None:
    from services.engines.vllm.config import CpuArgs

    os.environ.update(CpuArgs().environment())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    asked = json.load(sys.stdin)
    llm = LLM(model=sys.argv[1], disable_log_stats=True, dtype=asked["dtype"], **SETTINGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=asked["max_tokens"])
    outs = [
        llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0].outputs[0]
        for ids in asked["prompts"]
    ]
    answers = {"token_ids": [list(o.token_ids) for o in outs], "texts": [o.text for o in outs]}
    with open(sys.argv[2], "w") as out:
        json.dump(answers, out)


if __name__ == "__main__":
    main()
