"""What the scheduler asks of a request and of a model runner, and the step it plans.

The scheduler (scheduler.py) knows no model: it decides who runs and how far. A
model runner (one per model family: services/engines/transformers/runners/, the
Qwen3-Omni thinker and talker) owns the rows of its batch, picks the forward, runs
it and turns each row's result into its request's events. The split is vLLM v1's
scheduler / model runner (nano-vllm's ``schedule`` → ``run`` → ``postprocess``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from services.engines.base import EngineEvent


@dataclass(frozen=True)
class WindowEnd:
    """Handed to a request after a step when its next step must wait for input it has
    not been given (its ``ready`` is False): ``given`` is how much it had then (the
    talker: its thinker's answer rows). An engine fed window by window ends a window's
    events there (``Inbox.window``); one that reads a request whole never sees it."""

    given: int


# What a step hands a request: its new events, and where its input ran out.
Handed = EngineEvent | WindowEnd

# What the scheduler hands a request after a step: what the step handed it, or the
# error that ended it (its own, or the whole batch's).
Delivery = list[Handed] | BaseException


class Scheduled(Protocol):
    """A request as the scheduler sees it. The runner advances its prompt and turns
    its rows' results into events; the consumer side may set ``cancelled`` at any
    time, read by the model thread at step boundaries only."""

    request_id: str
    submitted: float  # clock time of submit
    admitted: float  # clock time of admission (0 until then)
    cancelled: bool
    finished: bool

    @property
    def deliver(self) -> Callable[[Delivery], None]:
        """Hands the request its events (thread-safe: called on the model thread)."""
        ...

    @property
    def remaining_prompt(self) -> int:
        """Prompt positions not yet through the model."""
        ...

    @property
    def ready(self) -> bool:
        """Whether it can take a decode step now (a talker whose next input has not
        come from its thinker yet cannot)."""
        ...


class Windowed(Protocol):
    """A request fed window by window (the talker, by its thinker's windows)."""

    @property
    def ready(self) -> bool:
        """As ``Scheduled.ready``: whether it can take a step with the input it has."""
        ...

    @property
    def given(self) -> int:
        """How much input it has been given so far (what ``WindowEnd.given`` counts)."""
        ...


R = TypeVar("R", bound=Scheduled)


@dataclass(frozen=True)
class Step(Generic[R]):
    """One forward's work: each of ``prefill`` reads up to ``chunk`` more prompt
    positions, each of ``decode`` one new position."""

    prefill: Sequence[R] = ()
    chunk: int = 0
    decode: Sequence[R] = ()


Outbox = dict[R, list[Handed]]


@dataclass(frozen=True)
class StepTaken:
    """What one forward ran, as an observer of the scheduler sees it (``watch``): the
    request ids reading prompt positions (up to ``chunk`` each) and those decoding."""

    prefill: tuple[str, ...]
    chunk: int
    decode: tuple[str, ...]

    @property
    def mixed(self) -> bool:
        return bool(self.prefill and self.decode)


class ModelRunner(Protocol[R]):
    """The model side of an engine: rows, forwards, sampling."""

    @property
    def mixes(self) -> bool:
        """Whether prefill and decode rows run as one forward (one read of the weights)."""
        ...

    def fits(self, members: Sequence[R]) -> bool:
        """Whether these requests, together, fit the memory the runner may use."""
        ...

    def admit(self, admitted: Sequence[R]) -> None:
        """Rows for requests joining now (a prompt prefix they share may run once)."""
        ...

    def run(self, step: Step[R]) -> Outbox[R]:
        """Run one step; each request that got a new position's result, its events.
        A request whose result cannot be used (its logits are NaN) is finished and
        delivered its error here."""
        ...

    def free(self, gone: Sequence[R]) -> None:
        """Drop the rows of requests that left (finished or cancelled)."""
        ...

    def reset(self) -> None:
        """Drop every row (after a step failed)."""
        ...
