"""The seams between stages, end to end over real processes: what the consuming
stage actually received, for every transport the data plane can choose.

    shm      the thinker's one consumer is on this node and its hidden states
             are over ``inline_max_bytes`` (1 KiB here): shared blocks, in pieces
    bytes    the thinker has two consumers, so no single identity: inline bytes
    chunked  bytes, and the orchestrator's ``chunk_bytes`` (1 KiB) cuts what it
             sends the renderer into TensorChunk messages

The renderer reports the prompt-embedding rows it conditioned on as
``prompt_tokens``: they must equal the thinker's generated tokens, however the
rows travelled and however they were windowed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.client import Result
from services.testing.configs import tiny_config
from tests.orchestrator.conftest import Stages, orchestrator, pipeline, renderer_config

ROOT = Path(__file__).resolve().parents[4]
SCRIPTED = "tests.helpers.engines:ScriptedEngine"  # echoes the token ids it receives
CHUNK_BYTES = 1024
HIDDEN = "hidden_states_to_prompt_embeds"


@pytest.fixture(scope="module")
async def stages(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
):
    stages = Stages(tmp_path_factory.mktemp("seams"), env={"PYTHONPATH": str(ROOT)})
    runtime = {"torch_threads": 1, "max_batch_size": 2, "max_queue_size": 16}
    decoder = {
        "engine": SCRIPTED,
        "load_format": "dummy",
        "cache_dir": str(omni_cache_dir),
        "segmenting": {"max_segment_tokens": 2, "min_flush_interval_ms": 0},
    }
    try:
        await stages.start(
            {
                # Segments of 4 rows of 64 float32 = 1 KiB: shared memory for a known
                # consumer; a shorter last segment stays inline.
                "thinker": tiny_config(
                    "thinker", omni_cache_dir, runtime={**runtime, "inline_max_bytes": 1024}
                ),
                "talker": tiny_config("talker", omni_cache_dir, runtime=runtime),
                "renderer": renderer_config(omni_cache_dir),
                "decoder": {"name": "decoder", **decoder, "runtime": {"streaming_input": True}},
                "joiner": {"name": "joiner", **decoder},
            }
        )
        yield stages
    finally:
        await stages.stop()


def hand_off(stages: Stages, transport: str, window: int):
    edges = [{"from": "thinker", "to": "renderer", "window": window, "transform": HIDDEN}]
    if transport != "shm":  # a second consumer: no single identity, so bytes
        edges.append({"from": "thinker", "to": "talker", "transform": "tokens"})
    names = ["thinker", "renderer", "talker"] if transport != "shm" else ["thinker", "renderer"]
    return pipeline(stages, names, edges, outputs=["thinker", "renderer"])


@pytest.mark.slow
@pytest.mark.parametrize("window", [-1, 5])
@pytest.mark.parametrize("transport", ["shm", "bytes", "chunked"])
async def test_the_renderer_conditions_on_every_generated_token(
    stages: Stages, transport: str, window: int
) -> None:
    options = {"chunk_bytes": CHUNK_BYTES} if transport == "chunked" else {}
    stage_params = {"renderer": {"seed": 1}}
    if transport != "shm":
        stage_params["talker"] = {"max_tokens": 2}
    async with orchestrator(hand_off(stages, transport, window), **options) as (_server, client):
        result = await client.generate(
            "Draw a red apple.", params={"max_tokens": 11, "seed": 4}, stage_params=stage_params
        ).collect()
    assert result.ok, result.done
    thinker = result.stages["thinker"].completed
    renderer = result.stages["renderer"].completed
    assert thinker is not None and renderer is not None
    assert thinker.usage.completion_tokens >= 5  # more than one segment, more than one window
    assert renderer.usage.prompt_tokens == thinker.usage.completion_tokens, (
        f"{transport}, window {window}: the renderer conditioned on "
        f"{renderer.usage.prompt_tokens} rows of {thinker.usage.completion_tokens}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(("consumer", "window"), [("decoder", 3), ("joiner", 3), ("joiner", -1)])
async def test_talker_windows_carry_every_token_once_in_order(
    stages: Stages, consumer: str, window: int
) -> None:
    edges = [
        {"from": "thinker", "to": "talker", "transform": "tokens"},
        {"from": "talker", "to": consumer, "window": window, "transform": "tokens"},
    ]
    config = pipeline(stages, ["thinker", "talker", consumer], edges, outputs=["talker", consumer])
    async with orchestrator(config) as (_server, client):
        result: Result = await client.generate(
            "Count.", params={"max_tokens": 3}, stage_params={"talker": {"max_tokens": 10}}
        ).collect()
    assert result.ok, result.done
    talked = result.stages["talker"].token_ids
    assert len(talked) >= 4
    # The consumer echoes what it received: every token once, in order.
    assert result.stages[consumer].token_ids == talked
    assert result.stages[consumer].completed.usage.prompt_tokens == len(talked)
