"""Start-up, every step published on the init bus:
model fetch -> device lock -> load -> memory plan -> warm-up -> READY (or FAILED).

The fetch comes before the device lock (docs/design.md, 'The init watchdog'): a download
needs no device, and the lock wait is never paused by the watchdog, so a stage
queued behind a neighbour that is still downloading would otherwise burn its
init budget on someone else's download.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from pathlib import Path

from services.engines.base import Engine
from services.engines.capabilities import (
    FetchesFiles,
    PlansKvCache,
    PreparesModel,
    SizesKvCache,
)
from services.mesh.errors import InitFailed, OmniError
from services.mesh.pb.omni.v1 import stage_pb2
from services.stage.config import StageConfig
from services.stage.startup import cpu_isa
from services.stage.startup.cache_dir import ready_cache_dir
from services.stage.startup.device_lock import DeviceLock
from services.stage.startup.fetch import FetchCancel, FetchCancelled, FetchResult, fetch_model
from services.stage.startup.init_bus import InitBus
from services.stage.startup.memory import engine_sized, free_device_memory, plan_memory

logger = logging.getLogger(__name__)


class BusDownloadHook:
    """Turns fetch callbacks (from a worker thread) into DOWNLOAD_* events."""

    def __init__(self, bus: InitBus) -> None:
        self._bus = bus

    def start(self, source: str, bytes_total: int | None) -> None:
        self._bus.publish(
            stage_pb2.DOWNLOAD_START,
            source=source,
            bytes_total=bytes_total or 0,
            message=f"fetching {source}",
        )

    def progress(self, bytes_done: int, bytes_total: int | None) -> None:
        self._bus.publish(
            stage_pb2.DOWNLOAD_PROGRESS, bytes_done=bytes_done, bytes_total=bytes_total or 0
        )

    def preparing(self, what: str) -> None:
        self._bus.publish(stage_pb2.PREPARE, message=what)

    def done(self, result: FetchResult, duration_s: float) -> None:
        self._bus.publish(
            stage_pb2.DOWNLOAD_DONE,
            source=result.source,
            bytes_done=result.nbytes,
            bytes_total=result.nbytes,
            cache_hit=result.cache_hit,
            duration_ms=duration_s * 1e3,
            message=_fetched(result),
        )


def _fetched(result: FetchResult) -> str:
    if result.cache_hit:
        return "cache hit"
    return f"fetched {result.nbytes} bytes" + (", sha256 verified" if result.verified else "")


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, OmniError):
        return exc.message
    # Operators read this on InitStatus; the type and text of a load error are
    # what they need to act on it (the traceback goes to the log).
    return f"{type(exc).__name__}: {exc}"[:1000]


async def _fetch(config: StageConfig, bus: InitBus, source: str) -> FetchResult:
    """The model (or an engine's other file) on local disk; cancelling this stops
    the fetching thread too (it keeps a partial download for the next start)."""
    cancel = FetchCancel()
    fetch = functools.partial(
        fetch_model,
        source,
        config.resolved_cache_dir,
        BusDownloadHook(bus),
        stall_timeout_s=config.runtime.download_stall_timeout_s,
        cancel=cancel,
    )
    thread = asyncio.get_running_loop().run_in_executor(None, fetch)
    try:
        return await asyncio.shield(thread)
    except asyncio.CancelledError:
        cancel.cancel()
        with contextlib.suppress(Exception):
            await thread  # stops at its next read: the partial file is whole when we go
        raise


async def _fetch_file(config: StageConfig, bus: InitBus, name: str, source: str) -> Path:
    try:
        return (await _fetch(config, bus, source)).path
    except FetchCancelled:
        raise
    except InitFailed as exc:  # which of the engine's files (the message names the source)
        raise InitFailed(f"{config.engine} file {name!r}: {exc.message}", field=exc.field) from exc


async def start_up(config: StageConfig, engine: Engine, bus: InitBus) -> bool:
    """Bring the engine up. True on READY; False after publishing FAILED."""
    began = time.monotonic()
    runtime = config.runtime
    bus.publish(
        stage_pb2.STARTING,
        message=f"engine {config.engine}, model {config.model}, load_format {config.load_format}",
    )
    lock: DeviceLock | None = None
    try:
        ready_cache_dir(config)
        model_path: Path | None = None
        if config.model is not None:
            model_path = (await _fetch(config, bus, config.model)).path
        if isinstance(engine, FetchesFiles):
            files = {
                name: await _fetch_file(config, bus, name, source)
                for name, source in engine.sources().items()
            }
            engine.use_files(files)
        if runtime.uses_device_lock:
            lock = DeviceLock(runtime.device, owner=config.name, lock_dir=runtime.lock_dir)

            def on_wait(holder: str) -> None:
                bus.publish(
                    stage_pb2.DEVICE_LOCK_WAIT,
                    device=runtime.device,
                    holder=holder,
                    message=f"waiting for device {runtime.device}, held by {holder}",
                )

            waited = await lock.acquire(runtime.stage_init_timeout_s, on_wait=on_wait)
            bus.publish(
                stage_pb2.DEVICE_LOCK_ACQUIRED,
                device=runtime.device,
                duration_ms=waited * 1e3,
                message=f"acquired device {runtime.device} after {waited:.1f}s",
            )
        if model_path is not None and isinstance(engine, PreparesModel):
            step = engine.preparation(model_path)
            if step is not None:
                bus.publish(stage_pb2.PREPARE, message=step)
                await asyncio.to_thread(engine.prepare, model_path)
        # Before anything of oneDNN runs in this process or those the engine starts.
        isa_note = await asyncio.to_thread(cpu_isa.guard)
        what = model_path.name if model_path else f"a dummy {config.engine} model"
        bus.publish(stage_pb2.LOAD_START, message=f"loading {what}")
        free_before: int | None = None  # an engine sizing its own KV cache: not measured
        if not isinstance(engine, SizesKvCache):
            free_before = free_device_memory(runtime.device)
        t0 = time.monotonic()
        info = await asyncio.to_thread(engine.load, model_path)
        bus.compute = "; ".join(part for part in (info.compute, isa_note) if part)
        if bus.compute:
            logger.info("stage %s computes on: %s", config.name, bus.compute)
        bus.publish(
            stage_pb2.LOAD_DONE, duration_ms=(time.monotonic() - t0) * 1e3, message=info.description
        )
        if isinstance(engine, SizesKvCache):
            pages, page_size = engine.kv_cache()
            plan = engine_sized(runtime.memory_ratio, info.model_bytes, info.kv, pages, page_size)
        else:
            assert free_before is not None
            plan = plan_memory(
                free_before, runtime.memory_ratio, info.model_bytes, info.kv, runtime.page_size
            )
        bus.publish(
            stage_pb2.MEMORY_PLANNED,
            memory=stage_pb2.MemoryPlan(
                free_before_bytes=plan.free_before_bytes,
                memory_ratio=plan.memory_ratio,
                model_bytes=plan.model_bytes,
                bytes_per_page=plan.bytes_per_page,
                cache_pages=plan.cache_pages,
                cache_budget_bytes=plan.cache_budget_bytes,
                page_size=plan.page_size,
            ),
            message=f"model {plan.model_bytes} bytes, {plan.cache_pages} KV pages",
        )
        if info.kv is not None and isinstance(engine, PlansKvCache):
            # The engine admits requests only while their KV fits these pages.
            engine.plan_kv_cache(plan.cache_pages, plan.page_size)
        t0 = time.monotonic()
        bus.publish(stage_pb2.WARMUP, message="first forward")
        await asyncio.to_thread(engine.warmup)
        warmup_ms = (time.monotonic() - t0) * 1e3
        bus.publish(
            stage_pb2.READY,
            duration_ms=warmup_ms,  # the phase READY closes, as every *_DONE event
            message=f"warm-up took {warmup_ms:.0f} ms, start-up "
            f"{(time.monotonic() - began):.1f} s in all",
        )
        return True
    except asyncio.CancelledError:
        bus.publish(stage_pb2.FAILED, reason="start-up cancelled (the stage is shutting down)")
        raise
    except Exception as exc:
        if not isinstance(exc, OmniError):
            logger.exception("stage %s: start-up failed", config.name)
        bus.publish(stage_pb2.FAILED, reason=_failure_reason(exc))
        return False
    finally:
        if lock is not None:
            lock.release()
