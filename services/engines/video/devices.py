"""One in-order work queue per device, the same API on CPU and CUDA.

A ``DeviceQueue`` runs the tasks submitted to it one at a time, in submission
order, on its own thread: on a CPU that thread is the device; on CUDA it
enqueues the task's kernels on the queue's stream and records an event after
them. A task names the ``Work`` it depends on; before it runs, the queue waits
for that work's host future (so the producer's event has been recorded) and,
on CUDA, makes its stream wait for the producer's event (``wait_event``), then
marks the inputs as used on its stream (``record_stream``) so the caching
allocator cannot hand their memory out before this stream is done with them.
Cross-device copies are tasks of a side queue, synchronised the same way.

Every queue can keep a timeline of its tasks (label, host start, host end), so
a test can see which windows ran on which device at the same time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Span:
    queue: str
    label: str
    start: float
    end: float


class Timeline:
    """Task spans of several queues, on one monotonic clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Span] = []

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def of(self, queue: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.queue == queue]


@dataclass(frozen=True)
class Work:
    """A task's result once ``future`` is done; on CUDA its kernels may still run
    until ``event`` has completed."""

    future: Future[Any]
    event: torch.cuda.Event | None = None

    def wait(self) -> Any:
        """Block until the result is really there (host and device)."""
        value = self.future.result()
        if self.event is not None:
            self.event.synchronize()
        return value


class DeviceQueue:
    def __init__(self, name: str, device: torch.device, timeline: Timeline | None = None) -> None:
        self.name = name
        self.device = device
        self._timeline = timeline
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"video-{name}")
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=device) if device.type == "cuda" else None
        )

    def submit(self, label: str, fn: Callable[..., Any], *deps: Work) -> Work:
        """Run ``fn(*dep results)`` after every earlier task of this queue and after ``deps``."""
        event = torch.cuda.Event() if self.stream is not None else None
        future = self._executor.submit(self._run, label, fn, deps, event)
        return Work(future, event)

    def _run(
        self,
        label: str,
        fn: Callable[..., Any],
        deps: tuple[Work, ...],
        event: torch.cuda.Event | None,
    ) -> Any:
        inputs = [dep.future.result() for dep in deps]  # their events are recorded now
        start = time.monotonic()
        stream = self.stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None:
                for dep in deps:
                    if dep.event is not None:
                        stream.wait_event(dep.event)
                for value in inputs:
                    _record_stream(value, stream)
            result = fn(*inputs)
            if event is not None:
                event.record(stream)
        if self._timeline is not None:
            self._timeline.add(Span(self.name, label, start, time.monotonic()))
        return result

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def copy_to(queue: DeviceQueue, label: str, source: Work, device: torch.device) -> Work:
    """``source``'s tensors copied to ``device`` on the side ``queue``; its
    consumers wait for the copy like for any other work."""

    def copy(value: Any) -> Any:
        # On a CPU the copy is a real one, so the two "devices" share no memory.
        return _map(value, lambda t: _copy_one(t, device))

    return queue.submit(label, copy, source)


def _copy_one(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.is_cuda and tensor.device != device:
        # A copy between two GPUs runs on the source device's current stream: the
        # source's memory must not be reused before that stream is past the copy.
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return tensor.to(device, non_blocking=True, copy=True)


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map(v, fn) for v in value)
    return value


def _record_stream(value: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_cuda and value.device == stream.device:
            value.record_stream(stream)
    elif isinstance(value, tuple):
        for item in value:
            _record_stream(item, stream)
