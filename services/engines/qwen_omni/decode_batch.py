"""code2wav's chunks of many requests, decoded together: one thread owns the model and
takes every chunk waiting, one forward per shape (requests in their steady state all
send ``left_context + chunk_size`` codes, so they share one), then hands each request
its audio on its event loop (LoopPost: one wake for a burst).

Convolutions and products over a batch are not batch-invariant on a CPU: a request's
audio in a batch equals its audio alone up to float32 rounding (the tests bound it
by the plain path's own error against float64).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engines.scheduler.loop_post import loop_post

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    codes: torch.Tensor  # [1, G, T]
    done: Callable[[torch.Tensor | BaseException], None]  # thread-safe


class DecodeBatches:
    def __init__(self, decode: Callable[[torch.Tensor], torch.Tensor], max_batch: int) -> None:
        self._decode = decode  # codes [B, G, T] -> waveform [B, 1, samples]
        self._max_batch = max_batch
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._closed = False
        self.batches: list[int] = []  # requests per forward, the last few (metrics, tests)
        self._thread = threading.Thread(target=self._loop, name="code2wav-batches", daemon=True)
        self._thread.start()

    async def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The waveform [1, 1, samples] of one chunk ``codes`` [1, G, T]."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        post = loop_post(loop)

        def done(result: torch.Tensor | BaseException) -> None:
            post.post(lambda got: _settle(future, got), result)

        with self._cond:
            if self._closed:
                raise RuntimeError("the code2wav engine is closed")
            self._jobs.append(_Job(codes, done))
            self._cond.notify()
        return await future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._jobs):
                    self._cond.wait()
                if self._closed:
                    jobs, self._jobs = self._jobs, []
                    for job in jobs:
                        job.done(RuntimeError("the code2wav engine closed"))
                    return
                jobs, self._jobs = self._jobs, []
            shapes: dict[tuple[int, ...], list[_Job]] = defaultdict(list)
            for job in jobs:
                shapes[tuple(job.codes.shape)].append(job)
            for group in shapes.values():
                for start in range(0, len(group), self._max_batch):
                    self._run(group[start : start + self._max_batch])

    def _run(self, jobs: list[_Job]) -> None:
        self.batches = [*self.batches[-255:], len(jobs)]
        try:
            with torch.no_grad():
                wave = self._decode(torch.cat([job.codes for job in jobs]))
        except Exception as exc:  # a model error: these chunks' requests fail, not the engine
            logger.exception("code2wav: decoding %d chunks failed", len(jobs))
            for job in jobs:
                job.done(exc)
            return
        for index, job in enumerate(jobs):
            job.done(wave[index : index + 1])


def _settle(future: asyncio.Future[torch.Tensor], result: torch.Tensor | BaseException) -> None:
    if future.done():
        return  # its request was cancelled meanwhile
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
