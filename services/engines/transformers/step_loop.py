"""Continuous batching: the engine's step loop, on the one thread that owns the model.

Each step (the nano-vllm / mini-sglang shape):

1. retire what was cancelled since the last step (its consumer stopped iterating);
2. admit waiting requests in arrival order while the batch has room
   (``max_batch_size`` sequences) and the KV plan has pages for them; the head
   of the queue waits for pages rather than being overtaken; requests admitted
   together whose prompts share a prefix (a chat template's system prompt) run
   it once;
3. prefill: one forward over every admitted request still reading its prompt,
   each advancing by one chunk (shortest remaining prompt sets the chunk, so a
   short prompt finishes in its first step and a long one cannot hold it back;
   the oldest always advances, so none starves); a request whose prompt is done
   gets its first token, handed over before the decode forward runs, and moves
   to the decode batch;
4. decode: every running request, one token each;
5. hand each request its events and drop the finished rows.

When both prefill and decode have work they share one forward (mixed_step.py: one
flat sequence, no padding of the decode rows, attention per part), so a step reads
the weights once; a request whose prompt completes in it decodes from the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from services.engines.base import EngineEvent
from services.engines.transformers import mixed_step
from services.engines.transformers.arrivals import Arrivals
from services.engines.transformers.kv_rows import KvRows
from services.engines.transformers.sequence import Sequence, emit_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int
    prefill_tokens: int  # prompt tokens one prefill forward may take, all rows together
    kv_pages: int | None = None  # None: no memory plan (an engine used outside a stage)
    page_size: int = 16
    # An idle loop waits up to this long after a first arrival for the requests
    # announced with it (``expect``) or arriving close behind it, so that they
    # share their prefill.
    gather_s: float = 0.0


# Shorter common prefixes are not worth a forward of their own.
_MIN_SHARED_PREFIX = 16


class StepLoop:
    def __init__(
        self,
        model: PreTrainedModel,
        limits: BatchLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._model = model
        self._embed = model.get_input_embeddings()
        self._device, self._dtype = model.device, model.dtype
        self._hidden_size = int(model.config.get_text_config(decoder=True).hidden_size)
        self._clock = clock
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._arrivals = Arrivals(limits.gather_s, clock)
        self._closed = False
        self._waiting: deque[Sequence] = deque()
        self._prefilling: list[Sequence] = []
        self._prefill_kv = KvRows(model)
        self._running: list[Sequence] = []
        self._running_kv = KvRows(model)
        self._mixed = mixed_step.enable(model)
        self._thread = threading.Thread(target=self._loop, name="transformers-steps", daemon=True)
        self._thread.start()

    # -- from the event loop ----------------------------------------------------

    def expect(self) -> None:
        """A request was checked and is on its way to ``submit`` (a stage checks
        each request just before it runs it): what makes gathering worth a wait."""
        with self._cond:
            self._arrivals.expect()
            self._cond.notify()

    def submit(self, sequence: Sequence) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the transformers engine is closed")
            self._arrivals.arrived()
            self._inbox.append(sequence)
            self._cond.notify()

    def wake(self) -> None:
        """Something changed (a cancel): let the loop look at it now."""
        with self._cond:
            self._cond.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # -- the model thread ------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._inbox or self._busy()):
                    self._cond.wait()
                if self._closed:
                    break
                if not self._busy():
                    self._gather()
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                with torch.inference_mode():
                    self.step()
            except Exception as exc:  # a model error: fail this batch, keep serving
                logger.exception("transformers step failed; failing %d requests", self._count())
                self._fail_all(exc)
        self._fail_all(RuntimeError("the transformers engine closed"))

    def _gather(self) -> None:
        """With the lock held: wait, up to ``gather_s``, while more arrivals are
        likely (arrivals.py); a lone request waits ``ARRIVAL_GAP_S`` at most."""
        deadline = self._clock() + self.limits.gather_s
        while not self._closed and len(self._inbox) < self.limits.max_batch_size:
            left = self._arrivals.wait_until(deadline) - self._clock()
            if left <= 0:
                break
            self._cond.wait(left)

    def _busy(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running)

    def _count(self) -> int:
        return len(self._waiting) + len(self._prefilling) + len(self._running)

    def step(self) -> None:
        outbox: dict[Sequence, list[EngineEvent]] = {}
        self._retire()
        self._admit()
        if self._prefilling and self._running and self._mixed:
            self._mixed_step(outbox)
        else:
            if self._prefilling:
                self._prefill(outbox)
                # First tokens leave now, not after the decode forward below: a
                # request's time to first token is its prefill, not prefill + a step.
                _deliver(outbox)
            if self._running:
                self._decode(outbox)
        _deliver(outbox)

    def _retire(self) -> None:
        self._waiting = deque(s for s in self._waiting if not _gone(s))
        self._prefilling = _keep(self._prefilling, self._prefill_kv)
        self._running = _keep(self._running, self._running_kv)

    def _admit(self) -> None:
        admitted: list[Sequence] = []
        while self._waiting and self._fits(self._waiting[0], admitted):
            sequence = self._waiting.popleft()
            sequence.admitted = self._clock()
            admitted.append(sequence)
        if not admitted:
            return
        sharing, alone = self._shared_prefix(admitted)
        self._prefilling += sharing + alone
        self._prefill_kv.add_rows(len(alone))

    def _shared_prefix(self, admitted: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Requests admitted together whose prompts start alike (a chat template's
        system prompt) run that prefix once and copy its KV rows; returns them and
        the rest. Their own tokens (at least the last one) still go through prefill."""
        ids = [s for s in admitted if s.plan.embeds is None]
        if len(ids) < 2:
            return [], admitted
        prompts = [s.plan.token_ids for s in ids]
        length = min(len(p) for p in prompts) - 1
        for column in range(length):
            if any(p[column] != prompts[0][column] for p in prompts[1:]):
                length = column
                break
        if length < _MIN_SHARED_PREFIX:
            return [], admitted
        shared = KvRows(self._model, rows=1)
        embeds = ids[0].prompt_chunk(length, self._embed)[None]
        valid = torch.ones(1, length, dtype=torch.long, device=self._device)
        shared.forward(embeds, valid, hidden=False)
        shared.repeat(len(ids))
        for sequence in ids[1:]:
            sequence.prefilled = length
        self._prefill_kv.concat(shared)
        return ids, [s for s in admitted if s.plan.embeds is not None]

    def _fits(self, candidate: Sequence, admitted: list[Sequence]) -> bool:
        members = [*self._prefilling, *self._running, *admitted, candidate]
        if len(members) > self.limits.max_batch_size:
            return False
        if self.limits.kv_pages is None:
            return True
        # The padded layout gives every row the width of the longest one.
        widest = max(s.pages(self.limits.page_size) for s in members)
        return len(members) * widest <= self.limits.kv_pages

    def _mixed_step(self, outbox: dict[Sequence, list[EngineEvent]]) -> None:
        prefilling, running = self._prefilling, self._running
        embeds_p, valid, done = self._prefill_inputs()
        hidden = any(s.plan.return_hidden_states for s in running) or any(
            prefilling[i].plan.return_hidden_states for i in done
        )
        logits, states = mixed_step.mixed_forward(
            self._model,
            (self._prefill_kv, embeds_p, valid),
            (self._running_kv, self._decode_inputs()),
            hidden,
        )
        split = len(prefilling)
        self._after_decode(logits[split:], None if states is None else states[split:], outbox)
        self._after_prefill(
            done, logits[:split], None if states is None else states[:split], outbox
        )

    def _prefill(self, outbox: dict[Sequence, list[EngineEvent]]) -> None:
        embeds, valid, done = self._prefill_inputs()
        hidden = any(self._prefilling[i].plan.return_hidden_states for i in done)
        logits, states = self._prefill_kv.forward(embeds, valid, hidden)
        self._after_prefill(done, logits, states, outbox)

    def _prefill_inputs(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The next chunk of every prefilling row: embeds [rows, W, hidden], valid
        [rows, W] (left padding), and which rows read their last prompt token in it."""
        rows = self._prefilling
        width = self._chunk_width([s.remaining_prompt for s in rows])
        embeds = torch.zeros(
            len(rows), width, self._hidden_size, dtype=self._dtype, device=self._device
        )
        valid = torch.zeros(len(rows), width, dtype=torch.long, device=self._device)
        for i, sequence in enumerate(rows):
            count = min(sequence.remaining_prompt, width)
            embeds[i, width - count :] = sequence.prompt_chunk(count, self._embed)
            valid[i, width - count :] = 1
        return embeds, valid, [i for i, s in enumerate(rows) if s.remaining_prompt == 0]

    def _after_prefill(
        self,
        done: list[int],
        logits: torch.Tensor,
        states: torch.Tensor | None,
        outbox: dict[Sequence, list[EngineEvent]],
    ) -> None:
        rows = self._prefilling
        if not done:
            return
        emit_tokens(rows, done, logits, states, outbox)
        moving = [i for i in done if not rows[i].finished]
        self._running_kv.concat(self._prefill_kv.take(moving))
        self._running.extend(rows[i] for i in moving)
        self._prefilling = [s for s in rows if s.remaining_prompt > 0]
        self._prefill_kv.select([i for i, s in enumerate(rows) if s.remaining_prompt > 0])

    def _chunk_width(self, remaining: list[int]) -> int:
        """Columns of this prefill step: the shortest remaining prompt, stretched to
        take along others almost as short (bounded padding), within the budget."""
        shortest = min(remaining)
        slack = max(16, shortest // 4)
        width = max(r for r in remaining if r <= shortest + slack)
        budget = max(16, self.limits.prefill_tokens // len(remaining))
        return max(1, min(width, budget))

    def _decode(self, outbox: dict[Sequence, list[EngineEvent]]) -> None:
        embeds = self._decode_inputs()
        valid = torch.ones(embeds.shape[:2], dtype=torch.long, device=self._device)
        hidden = any(s.plan.return_hidden_states for s in self._running)
        logits, states = self._running_kv.forward(embeds, valid, hidden)
        self._after_decode(logits, states, outbox)

    def _decode_inputs(self) -> torch.Tensor:
        """Each running row's last token, embedded: [rows, 1, hidden]."""
        ids = torch.tensor([[s.last_token] for s in self._running], device=self._device)
        return self._embed(ids)

    def _after_decode(
        self,
        logits: torch.Tensor,
        states: torch.Tensor | None,
        outbox: dict[Sequence, list[EngineEvent]],
    ) -> None:
        rows = self._running
        emit_tokens(rows, list(range(len(rows))), logits, states, outbox)
        self._running = _keep(rows, self._running_kv)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        for sequence in [*self._waiting, *self._prefilling, *self._running]:
            sequence.finished = True
            sequence.deliver(error)
        self._waiting.clear()
        self._prefilling, self._running = [], []
        self._prefill_kv, self._running_kv = KvRows(self._model), KvRows(self._model)


def _deliver(outbox: dict[Sequence, list[EngineEvent]]) -> None:
    """Hand each request its events, emptying ``outbox``."""
    for sequence, events in outbox.items():
        sequence.deliver(events)
    outbox.clear()


def _gone(sequence: Sequence) -> bool:
    return sequence.finished or sequence.cancelled


def _keep(rows: list[Sequence], kv: KvRows) -> list[Sequence]:
    """Drop the finished and cancelled rows from ``rows`` and their KV batch."""
    keep = [i for i, s in enumerate(rows) if not _gone(s)]
    if len(keep) != len(rows):
        kv.select(keep)
    return [rows[i] for i in keep]
