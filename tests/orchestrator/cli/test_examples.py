"""The example pipelines in examples/pipelines/ come up and answer."""

from __future__ import annotations

from pathlib import Path

from orchestrator.cli.launcher import Launcher
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import load_pipeline
from tests.helpers.reference_answer import ReferenceLM

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "pipelines"
QUESTION = "What is the capital of France?"


async def run_example(name: str, tmp_path: Path, mesh: str, **params: object):
    launcher = Launcher(
        load_pipeline(EXAMPLES / name), run_dir=tmp_path / "run", mesh_id=mesh, port=0
    )
    try:
        await launcher.start()
        async with AsyncClient(launcher.address) as client:
            await client.wait_ready(timeout_s=240)
            return await client.generate(QUESTION, params=params).collect()
    finally:
        await launcher.stop()


async def test_chat_example_answers(
    tmp_path: Path, omni_cache_dir: Path, smollm2_reference: ReferenceLM
) -> None:
    result = await run_example("chat.yaml", tmp_path, "exchat", max_tokens=12)
    assert result.ok, result.done
    smollm2_reference.answer(QUESTION, 12).assert_said(result.stages["chat"].token_ids)


async def test_talker_example_decodes_windows_as_they_arrive(
    tmp_path: Path, omni_cache_dir: Path, smollm2_reference: ReferenceLM
) -> None:
    result = await run_example("talker.yaml", tmp_path, "extalker", max_tokens=12)
    assert result.ok, result.done
    smollm2_reference.answer(QUESTION, 12).assert_said(result.stages["thinker"].token_ids)
    decoder = result.stages["decoder"]
    # The talker says 32 tokens; the decoder takes them as they arrive, in a first
    # window of 2 and then windows of 8 (2, 8, 8, 8, 6), and decodes 4 tokens per
    # window: 5 windows, 20 tokens, one request.
    assert len(decoder.token_ids) == 20
    assert decoder.completed is not None and decoder.completed.usage.prompt_tokens == 32
