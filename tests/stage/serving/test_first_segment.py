"""The first token of a request reaches a real gRPC client in a segment of its own:
it does not wait for ``max_segment_tokens`` of company (nor for
``min_flush_interval_ms``), while later tokens are still batched as configured."""

from __future__ import annotations

from pathlib import Path

from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config
from tests.helpers.stage import Result, chat, collect

MAX_TOKENS = 13  # a first token, then three full segments of 4


async def generate_one(segmenting: dict[str, float], omni_cache_dir: Path) -> Result:
    # An interval far longer than the run: only token counts flush segments.
    config = tiny_config("first-segment", omni_cache_dir, segmenting=segmenting)
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=300)
            call = client.open_stream()
            await call.write(chat("r", "Count to ten.", max_tokens=MAX_TOKENS))
            await call.done_writing()
            return (await collect(call))["r"]
    finally:
        await server.stop(1.0)


async def test_the_first_token_leaves_alone_and_the_rest_in_full_segments(
    omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    result = await generate_one(
        {"max_segment_tokens": 4, "min_flush_interval_ms": 60_000}, omni_cache_dir
    )
    assert result.completed is not None and result.segments[-1].is_last
    sizes = [len(s.token_ids) for s in result.segments]  # in the order the client read them
    assert sum(sizes) == result.completed.usage.completion_tokens, sizes
    # The random weights end the answer early only by a rare end-of-text token;
    # before the last segment (the rest) every one after the first is full.
    assert sizes[0] == 1 and all(n == 4 for n in sizes[1:-1]) and sizes[-1] <= 4, sizes


async def test_first_segment_tokens_can_ask_for_a_fuller_first_segment(
    omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    result = await generate_one(
        {"max_segment_tokens": 4, "min_flush_interval_ms": 60_000, "first_segment_tokens": 4},
        omni_cache_dir,
    )
    assert result.completed is not None
    sizes = [len(s.token_ids) for s in result.segments]
    assert sizes[0] == min(4, result.completed.usage.completion_tokens), sizes
