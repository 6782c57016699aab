"""What every engine under the scheduler shares, written once: its scheduler, built
at load from the runner and its limits ("call load() first" before then), a request's
seeded generator, a request's run (submitted; on every way out, its end, ``aclose``
or the consuming task cancelled, a request not finished is cancelled and the model
thread woken to drop it at its next step), and close. The engines (the transformers
engine, the Qwen3-Omni thinker and talker) keep what is theirs: intake, their
request type and their runner. The talker, whose request outlives each window's
``generate``, submits it once and cancels it at its release.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic

import torch

from services.engines.scheduler.contract import ModelRunner, R
from services.engines.scheduler.scheduler import Limits, Scheduler


class EngineShell(Generic[R]):
    def __init__(self, owner: str, device: str) -> None:
        self._owner = owner  # the engine's name, in "call load() first"
        self._device = device
        self._scheduler: Scheduler[R] | None = None

    def start(self, runner: ModelRunner[R], limits: Limits, name: str) -> None:
        """A scheduler over ``runner`` (its model thread named ``name``), replacing any."""
        self.close()
        self._scheduler = Scheduler(runner, limits, name=name)

    @property
    def scheduler(self) -> Scheduler[R]:
        if self._scheduler is None:
            raise RuntimeError(f"{self._owner}: call load() first")
        return self._scheduler

    def generator(self, seed: int | None) -> torch.Generator:
        """A request's own random generator: ``seed``'s, or fresh entropy."""
        generator = torch.Generator(device=self._device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator

    def submit(self, request: R) -> None:
        self.scheduler.submit(request)

    def cancel(self, request: R) -> None:
        """A request not finished is cancelled: the scheduler drops it (and its rows) at
        its next step."""
        if not request.finished:
            request.cancelled = True
            if self._scheduler is not None:
                self._scheduler.wake()

    @contextmanager
    def running(self, request: R) -> Iterator[None]:
        """``request`` submitted for the block (which reads its deliveries); on every
        way out of it, a request not finished is cancelled."""
        self.submit(request)
        try:
            yield
        finally:
            self.cancel(request)

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
