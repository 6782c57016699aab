"""The diffusers engine on a tiny random-weight pipeline: real diffusers, no mocks."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from services.engines.base import (
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ProgressOutput,
    SamplingParams,
    TensorOutput,
)
from services.engines.diffusers import DiffusersEngine, build_dummy_pipeline
from services.engines.diffusers.images import latent_preview
from services.mesh.errors import InitFailed, InvalidArgument
from services.testing.engine_runs import generate

EMBEDS = "inputs.tensors.prompt_embeds"
NATIVE = 16  # the dummy pipeline's image side: latent 8, VAE factor 2
LONG_RUN = 1000  # steps: far more than a cancelled run may get through


@pytest.fixture(scope="module")
def engine() -> Iterator[DiffusersEngine]:
    engine = DiffusersEngine(EngineSettings(load_format="dummy"))
    engine.load(Path("unused-for-dummy"))
    engine.warmup()
    yield engine
    engine.close()


def request(rid: str = "r", text: str | None = "a red cube", **params: Any) -> EngineRequest:
    tensors = params.pop("tensors", {})
    return EngineRequest(rid, text=text, tensors=tensors, params=SamplingParams(**params))


def embeds_request(embeds: torch.Tensor, **params: Any) -> EngineRequest:
    return request(text=None, tensors={"prompt_embeds": embeds}, **params)


async def collect(stream: AsyncIterator[EngineEvent]) -> list[EngineEvent]:
    return await asyncio.wait_for(_drain(stream), timeout=60)


async def _drain(stream: AsyncIterator[EngineEvent]) -> list[EngineEvent]:
    return [event async for event in stream]


def image_of(events: list[EngineEvent]) -> torch.Tensor:
    assert isinstance(events[-1], FinishOutput) and events[-1].reason == "done"
    output = events[-2]
    assert isinstance(output, TensorOutput)
    return output.tensors["image"]


@pytest.fixture
def unet_calls(engine: DiffusersEngine) -> Iterator[list[int]]:
    """One entry per denoiser forward pass, i.e. per step actually run."""
    calls: list[int] = []
    unet: torch.nn.Module = engine.pipeline.unet
    handle = unet.register_forward_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


async def test_dummy_pipeline_generates_a_uint8_image(engine: DiffusersEngine) -> None:
    info = DiffusersEngine(EngineSettings(load_format="dummy")).load(Path("x"))
    assert info.model_bytes > 0 and info.kv is None
    events = await collect(generate(engine, request(num_inference_steps=2, seed=1)))
    image = image_of(events)
    assert image.dtype == torch.uint8 and image.shape == (NATIVE, NATIVE, 3)
    assert image.device.type == "cpu"
    assert not any(isinstance(e, ProgressOutput) for e in events)  # previews off by default


async def test_png_blob_decodes_to_the_same_image(engine: DiffusersEngine) -> None:
    params: dict[str, Any] = {
        "num_inference_steps": 2,
        "seed": 3,
        "height": 24,
        "width": 32,
        "return_png": True,
    }
    events = await collect(generate(engine, request(**params)))
    image = image_of(events)
    output = events[-2]
    assert isinstance(output, TensorOutput) and len(output.blobs) == 1
    blob = output.blobs[0]
    assert (blob.name, blob.media_type) == ("image", "image/png")
    decoded = Image.open(io.BytesIO(blob.data))
    assert decoded.size == (32, 24)
    assert torch.equal(torch.from_numpy(np.array(decoded)), image)


async def test_previews_come_every_k_steps_and_are_small(engine: DiffusersEngine) -> None:
    events = await collect(generate(engine, request(num_inference_steps=6, preview_every=2)))
    progress = [e for e in events if isinstance(e, ProgressOutput)]
    assert [p.step for p in progress] == [2, 4, 6]
    assert all(p.total_steps == 6 for p in progress)
    for p in progress:
        assert p.preview is not None and p.preview.dtype == torch.uint8
        assert p.preview.ndim == 3 and p.preview.shape[2] == 3 and max(p.preview.shape[:2]) <= 64


def test_previews_of_large_latents_are_downscaled() -> None:
    preview = latent_preview(torch.randn(1, 4, 200, 100))
    assert preview is not None and preview.shape == (64, 32, 3) and preview.dtype == torch.uint8
    assert latent_preview(torch.randn(1, 64, 16)) is None  # packed latents: no preview


async def test_same_seed_same_image_different_seed_different(engine: DiffusersEngine) -> None:
    a = image_of(await collect(generate(engine, request("a", num_inference_steps=2, seed=7))))
    b = image_of(await collect(generate(engine, request("b", num_inference_steps=2, seed=7))))
    c = image_of(await collect(generate(engine, request("c", num_inference_steps=2, seed=8))))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


async def test_prompt_embeds_condition_the_image(engine: DiffusersEngine) -> None:
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 32, generator=generator), torch.randn(5, 32, generator=generator)

    async def render(embeds: torch.Tensor, **params: Any) -> torch.Tensor:
        rq = embeds_request(embeds, num_inference_steps=2, seed=1, **params)
        return image_of(await collect(generate(engine, rq)))

    image = await render(a)
    assert image.shape == (NATIVE, NATIVE, 3)
    assert torch.equal(await render(a[None]), image)  # [1, seq, dim] is the same input
    assert not torch.equal(await render(b), image)
    guided = await render(a, guidance_scale=3.0)  # guidance against zero embeddings
    assert guided.shape == image.shape and not torch.equal(guided, image)


async def test_prompt_embeds_of_the_wrong_width_name_the_field(engine: DiffusersEngine) -> None:
    rq = embeds_request(torch.randn(5, 16))
    with pytest.raises(InvalidArgument) as caught:
        engine.check(rq)
    assert caught.value.field == "inputs.tensors.prompt_embeds" and "32" in caught.value.message


async def test_saved_folder_loads_and_matches_the_dummy(
    engine: DiffusersEngine, tmp_path: Path
) -> None:
    build_dummy_pipeline().save_pretrained(tmp_path / "archive" / "pipeline")
    loaded = DiffusersEngine(EngineSettings())
    try:
        # An unpacked archive wraps the pipeline in one folder; both paths load.
        for path in (tmp_path / "archive" / "pipeline", tmp_path / "archive"):
            info = loaded.load(path)
            assert info.description == "StableDiffusionPipeline" and info.model_bytes > 0
        rq = request(num_inference_steps=2, seed=5)
        from_folder = image_of(await collect(generate(loaded, rq)))
    finally:
        loaded.close()
    assert torch.equal(from_folder, image_of(await collect(generate(engine, rq))))


def test_a_folder_without_a_pipeline_fails_to_load(tmp_path: Path) -> None:
    with pytest.raises(InitFailed, match=r"model_index\.json"):
        DiffusersEngine(EngineSettings()).load(tmp_path)


async def assert_worker_idle(engine: DiffusersEngine, calls: list[int]) -> None:
    """The cancelled run has left the worker thread: a 1-step request runs at once
    and the denoiser is not called behind it."""
    started = time.monotonic()
    await collect(generate(engine, request("after", num_inference_steps=1)))
    assert time.monotonic() - started < 5
    settled = len(calls)
    await asyncio.sleep(0.2)
    assert len(calls) == settled


async def test_aclose_stops_the_run(engine: DiffusersEngine, unet_calls: list[int]) -> None:
    stream = generate(engine, request(num_inference_steps=LONG_RUN, preview_every=1))
    first = await asyncio.wait_for(anext(stream), timeout=30)
    assert isinstance(first, ProgressOutput)
    await stream.aclose()
    await assert_worker_idle(engine, unet_calls)
    assert len(unet_calls) < LONG_RUN // 2


async def test_cancelling_the_consumer_task_stops_the_run(
    engine: DiffusersEngine, unet_calls: list[int]
) -> None:
    first_progress = asyncio.Event()

    async def consume() -> None:
        async for event in generate(engine, request(num_inference_steps=LONG_RUN, preview_every=1)):
            if isinstance(event, ProgressOutput):
                first_progress.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_progress.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_worker_idle(engine, unet_calls)
    assert len(unet_calls) < LONG_RUN // 2


async def test_concurrent_requests_take_turns_and_all_finish(engine: DiffusersEngine) -> None:
    results = await asyncio.gather(
        *(collect(generate(engine, request(f"c{i}", num_inference_steps=2))) for i in range(3))
    )
    assert all(image_of(events).shape == (NATIVE, NATIVE, 3) for events in results)


async def test_engine_args_set_the_request_defaults() -> None:
    settings = EngineSettings(
        load_format="dummy",
        engine_args={"num_inference_steps": 3, "preview_every": 1, "cross_attention_dim": 48},
    )
    engine = DiffusersEngine(settings)
    try:
        engine.load(Path("x"))
        rq = embeds_request(torch.randn(4, 48))
        events = await collect(generate(engine, rq))
    finally:
        engine.close()
    assert [e.step for e in events if isinstance(e, ProgressOutput)] == [1, 2, 3]


def test_unknown_engine_args_are_refused_by_name() -> None:
    with pytest.raises(InitFailed) as caught:
        DiffusersEngine(EngineSettings(engine_args={"num_steps": 4}))
    assert caught.value.field == "engine_args.num_steps"


@pytest.mark.parametrize(
    ("rq", "field"),
    [
        (request(text=None), "inputs"),
        (request(tensors={"prompt_embeds": torch.zeros(3, 32)}), "inputs"),
        (EngineRequest("m", messages=(("user", "hi"),)), "inputs.messages"),
        (embeds_request(torch.zeros(32)), EMBEDS),
        (embeds_request(torch.zeros(2, 3, 32)), EMBEDS),
        (embeds_request(torch.zeros(0, 32)), EMBEDS),
        (embeds_request(torch.zeros(3, 32, dtype=torch.int64)), EMBEDS),
        (request(tensors={"image": torch.zeros(3)}), "inputs.tensors.image"),
        (request(num_inference_steps=0), "params.num_inference_steps"),
        (request(num_inference_steps=1001), "params.num_inference_steps"),
        (request(height=12), "params.height"),
        (request(height=4096), "params.height"),
        (request(width=0), "params.width"),
        (request(preview_every=-1), "params.preview_every"),
        (request(guidance_scale=-1.0), "params.guidance_scale"),
        (request(seed=-1), "params.seed"),
    ],
)
def test_check_names_the_bad_field(engine: DiffusersEngine, rq: EngineRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        engine.check(rq)
    assert caught.value.field == field


async def test_a_text_prompt_too_long_to_fit_is_refused_before_the_pipeline_tokenizes_it(
    engine: DiffusersEngine,
) -> None:
    # max_prompt_tokens 4096 by default; no token of the byte tokenizer covers 100 chars.
    with pytest.raises(InvalidArgument) as caught:
        engine.check(request(text="x" * 2_000_000))
    assert caught.value.field == "inputs.text"
    assert "4096" in caught.value.message and "without tokenizing" in caught.value.message
    long_but_fine = request(text="a red cube " * 2000, num_inference_steps=1)
    engine.check(long_but_fine)  # cut to the encoder's length by the pipeline, as before
    assert isinstance((await collect(generate(engine, long_but_fine)))[-1], FinishOutput)
