"""code2wav's chunks of many requests, decoded together: one thread owns the model
(scheduler/worker.py) and takes every chunk waiting, one forward per shape (requests
in their steady state all send ``left_context + chunk_size`` codes, so they share
one), then hands each request its audio on its event loop (LoopPost: one wake for a
burst).

Convolutions and products over a batch are not batch-invariant on a CPU: a request's
audio in a batch equals its audio alone up to float32 rounding (the tests bound it
by the plain path's own error against float64).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engines.scheduler.loop_post import loop_post
from services.engines.scheduler.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    codes: torch.Tensor  # [1, G, T]
    done: Callable[[torch.Tensor | BaseException], None]  # thread-safe


class DecodeBatches:
    def __init__(self, decode: Callable[[torch.Tensor], torch.Tensor], max_batch: int) -> None:
        self._decode = decode  # codes [B, G, T] -> waveform [B, 1, samples]
        self._max_batch = max_batch
        self.batches: list[int] = []  # requests per forward, the last few (metrics, tests)
        self._worker: Worker[_Job, list[_Job]] = Worker(
            "code2wav-batches",
            "the code2wav engine",
            take=self._take,
            run=self._run,
            fail=self._failed,
            end=_fail,
        )

    async def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The waveform [1, 1, samples] of one chunk ``codes`` [1, G, T]."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        post = loop_post(loop)

        def done(result: torch.Tensor | BaseException) -> None:
            post.post(lambda got: _settle(future, got), result)

        self._worker.submit(_Job(codes, done))
        return await future

    def close(self) -> None:
        self._worker.close()

    def _take(self, pending: list[_Job]) -> list[list[_Job]]:
        """Every chunk waiting, one batch per shape of at most ``max_batch``."""
        shapes: dict[tuple[int, ...], list[_Job]] = defaultdict(list)
        for job in pending:
            shapes[tuple(job.codes.shape)].append(job)
        pending.clear()
        most = self._max_batch
        return [g[n : n + most] for g in shapes.values() for n in range(0, len(g), most)]

    def _run(self, jobs: list[_Job]) -> None:
        self.batches = [*self.batches[-255:], len(jobs)]
        with torch.no_grad():
            wave = self._decode(torch.cat([job.codes for job in jobs]))
        for index, job in enumerate(jobs):
            job.done(wave[index : index + 1])

    def _failed(self, jobs: list[_Job], error: Exception) -> None:
        """A model error: these chunks' requests fail, not the engine."""
        logger.exception("code2wav: decoding %d chunks failed", len(jobs))
        _fail(jobs, error)


def _fail(jobs: list[_Job], error: Exception) -> None:
    for job in jobs:
        job.done(error)


def _settle(future: asyncio.Future[torch.Tensor], result: torch.Tensor | BaseException) -> None:
    if future.done():
        return  # its request was cancelled meanwhile
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
