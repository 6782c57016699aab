"""Concurrent diffusion requests that fit one pipeline call denoise as one batch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engines.base import (
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ProgressOutput,
    SamplingParams,
    TensorOutput,
)
from services.engines.diffusers import DiffusersEngine
from services.testing.engine_runs import generate

STEPS = 4


@pytest.fixture(scope="module")
def engine() -> Iterator[DiffusersEngine]:
    engine = DiffusersEngine(EngineSettings(load_format="dummy", max_batch_size=4))
    engine.load(Path("unused-for-dummy"))
    engine.warmup()
    yield engine
    engine.close()


@pytest.fixture
def unet_batches(engine: DiffusersEngine) -> Iterator[list[int]]:
    """The batch size of every denoiser forward pass."""
    sizes: list[int] = []
    unet: torch.nn.Module = engine.pipeline.unet

    def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        sample = args[0] if args else kwargs["sample"]
        sizes.append(int(sample.shape[0]))

    handle = unet.register_forward_pre_hook(record, with_kwargs=True)
    yield sizes
    handle.remove()


def request(rid: str, text: str, **params: Any) -> EngineRequest:
    params.setdefault("num_inference_steps", STEPS)
    return EngineRequest(rid, text=text, params=SamplingParams(**params))


async def collect(engine: DiffusersEngine, rq: EngineRequest) -> list[EngineEvent]:
    return await asyncio.wait_for(_drain(engine, rq), timeout=60)


async def _drain(engine: DiffusersEngine, rq: EngineRequest) -> list[EngineEvent]:
    return [event async for event in generate(engine, rq)]


def image_of(events: list[EngineEvent]) -> torch.Tensor:
    output = events[-2]
    assert isinstance(output, TensorOutput)
    return output.tensors["image"]


async def test_same_size_requests_denoise_together_with_their_own_previews(
    engine: DiffusersEngine, unet_batches: list[int]
) -> None:
    texts = ["a red cube", "a blue ball", "a green cone"]
    alone = [
        image_of(await collect(engine, request(f"a{i}", t, seed=i))) for i, t in enumerate(texts)
    ]
    unet_batches.clear()
    every = [1, 2, 0]  # previews per request: every step, every other step, none
    together = await asyncio.gather(
        *(
            collect(engine, request(f"b{i}", t, seed=i, preview_every=every[i]))
            for i, t in enumerate(texts)
        )
    )
    # The first request may start alone before the others arrive; the rest share.
    assert 2 in unet_batches or 3 in unet_batches, unet_batches
    assert len(unet_batches) < 3 * STEPS  # fewer denoiser passes than one by one
    for i, events in enumerate(together):
        steps = [e.step for e in events if isinstance(e, ProgressOutput)]
        assert steps == [s for s in range(1, STEPS + 1) if every[i] and s % every[i] == 0]
        finish = events[-1]
        assert isinstance(finish, FinishOutput) and finish.reason == "done"
        # Its own seed and prompt: the image it gets alone, up to batched fp32 sums.
        diff = (image_of(events).int() - alone[i].int()).abs().max()
        assert diff <= 2, f"request {i}: off by {diff}"
    assert not torch.equal(image_of(together[0]), image_of(together[1]))


async def test_requests_sent_together_share_the_first_call_and_a_full_batch_starts_at_once() -> (
    None
):
    # A window far longer than the test's timeout: the batch must start because it is
    # full, not because the window ran out.
    engine = DiffusersEngine(
        EngineSettings(load_format="dummy", max_batch_size=3, engine_args={"gather_ms": 60_000})
    )
    engine.load(Path("unused-for-dummy"))
    sizes: list[int] = []
    unet: torch.nn.Module = engine.pipeline.unet
    unet.register_forward_pre_hook(lambda _m, args: sizes.append(int(args[0].shape[0])))
    try:
        runs = await asyncio.wait_for(
            asyncio.gather(*(_drain(engine, request(f"t{i}", "a cube", seed=i)) for i in range(3))),
            timeout=30,
        )
    finally:
        engine.close()
    assert sizes == [3] * STEPS  # the first request waited for the two sent with it
    assert all(isinstance(events[-1], FinishOutput) for events in runs)


async def test_different_sizes_do_not_share_a_call(
    engine: DiffusersEngine, unet_batches: list[int]
) -> None:
    await asyncio.gather(
        collect(engine, request("s16", "a cube", height=16, width=16)),
        collect(engine, request("s32", "a cube", height=32, width=32)),
    )
    assert unet_batches == [1] * (2 * STEPS)


async def test_a_cancelled_member_leaves_the_batch_running(
    engine: DiffusersEngine, unet_batches: list[int]
) -> None:
    long = {"num_inference_steps": 12, "preview_every": 1}
    unet: torch.nn.Module = engine.pipeline.unet
    blocker_running, released = threading.Event(), threading.Event()

    def hold_the_blocker(_module: Any, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        # The blocker's first pass waits (on the worker) until keep and victim are
        # both in line, so the two share the next call however loaded the machine is.
        if released.is_set():
            return
        blocker_running.set()
        give_up = time.monotonic() + 30
        while engine.waiting < 2 and time.monotonic() < give_up:
            time.sleep(0.005)
        released.set()

    handle = unet.register_forward_pre_hook(hold_the_blocker, with_kwargs=True)
    try:
        blocker = asyncio.create_task(collect(engine, request("block", "x", num_inference_steps=2)))
        assert await asyncio.to_thread(blocker_running.wait, 30)
        keep = asyncio.create_task(collect(engine, request("keep", "a cube", seed=1, **long)))
        victim = generate(engine, request("victim", "a ball", seed=2, **long))
        first = await asyncio.wait_for(anext(victim), timeout=30)
        assert isinstance(first, ProgressOutput)
        await victim.aclose()
        events = await keep
        await blocker
    finally:
        handle.remove()
    assert isinstance(events[-1], FinishOutput) and events[-1].reason == "done"
    assert [e.step for e in events if isinstance(e, ProgressOutput)] == list(range(1, 13))
    assert 2 in unet_batches  # keep and victim shared the call after the blocker
