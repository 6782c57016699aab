"""``TextRunner``: what every text model runner shares: the rows of its batch and
their KV caches, a step's inputs, and each row's next token; the runners of the
model families (reference.py, llama_cpu.py) supply the forwards. What a batch may
hold of the KV plan is kv_budget.py's.

Requests reading their prompt and requests decoding keep separate caches (a
prefill step appends W columns to each of its rows, a decode step one), joined when
a prompt completes; a mixed step runs both in one forward where the runner can.
Requests admitted together whose prompts start alike (a chat template's system
prompt) run that prefix once and copy its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from services.engines.kv_cache import KvCache, KvShape
from services.engines.scheduler import Outbox, Step
from services.engines.transformers.runners.kv_budget import KvBudget
from services.engines.transformers.text_request import TextRequest, emit_tokens

# Shorter common prefixes are not worth a forward of their own.
MIN_SHARED_PREFIX = 16

# Logits of each row's newest position [rows, vocab] (float32), and the last
# layer's hidden state there [rows, hidden] where asked for.
Forwarded = tuple[torch.Tensor, torch.Tensor | None]

# A mixed step's two parts: the prefill rows (their cache, the chunk's embeddings
# [rows, W, hidden], and which of its positions are real [rows, W]) and the decode
# rows (their cache, and one new position each [rows, 1, hidden]).
PrefillPart = tuple[KvCache, torch.Tensor, torch.Tensor]
DecodePart = tuple[KvCache, torch.Tensor]


class TextRunner:
    """A text model's rows; subclasses implement ``forward`` (and ``mixed_forward``
    where ``mixes``)."""

    mixes = False

    def __init__(self, model: PreTrainedModel, budget: KvBudget | None) -> None:
        self.model = model
        self.budget = budget
        self._embed = model.get_input_embeddings()
        self._device, self._dtype = model.device, model.dtype
        config = model.config.get_text_config(decoder=True)
        self._hidden_size = int(config.hidden_size)
        self._shape = KvShape.of(config, model.dtype, model.device)
        self._prefilling: list[TextRequest] = []
        self._prefill_kv = KvCache(self._shape)
        self._running: list[TextRequest] = []
        self._running_kv = KvCache(self._shape)

    # -- the forwards a model family supplies ----------------------------------

    def forward(
        self, kv: KvCache, embeds: torch.Tensor, valid: torch.Tensor, hidden: bool
    ) -> Forwarded:
        """Run ``embeds`` [rows, W, hidden] as the next W columns of every row of ``kv``
        (``valid`` [rows, W]: real positions, each row's last ones: left padding)."""
        raise NotImplementedError

    def mixed_forward(self, prefill: PrefillPart, decode: DecodePart, hidden: bool) -> Forwarded:
        """The prefill rows' chunk and the decode rows' new positions in one forward:
        the prefill rows' results first."""
        raise NotImplementedError

    # -- the scheduler's ModelRunner -------------------------------------------

    def fits(self, members: Sequence[TextRequest]) -> bool:
        return self.budget is None or self.budget.fits(members)

    def admit(self, admitted: Sequence[TextRequest]) -> None:
        sharing, alone = self._shared_prefix(admitted)
        self._prefilling += [*sharing, *alone]
        self._prefill_kv.add_rows(len(alone))

    def run(self, step: Step[TextRequest]) -> Outbox[TextRequest]:
        assert len(step.prefill) in (0, len(self._prefilling)) and len(step.decode) in (
            0,
            len(self._running),
        ), "a text runner steps all its prefilling or decoding rows"
        outbox: Outbox[TextRequest] = {}
        if step.prefill:
            embeds, valid, done = self._prefill_inputs(step.chunk)
            hidden = any(self._prefilling[i].plan.return_hidden_states for i in done)
            if step.decode:
                hidden = hidden or any(s.plan.return_hidden_states for s in self._running)
                logits, states = self.mixed_forward(
                    (self._prefill_kv, embeds, valid),
                    (self._running_kv, self._decode_inputs()),
                    hidden,
                )
                split = len(self._prefilling)
                emit_tokens(
                    self._running,
                    list(range(len(self._running))),
                    logits[split:],
                    None if states is None else states[split:],
                    outbox,
                )
                logits, states = logits[:split], None if states is None else states[:split]
            else:
                logits, states = self.forward(self._prefill_kv, embeds, valid, hidden)
            self._after_prefill(done, logits, states, outbox)
        elif step.decode:
            embeds = self._decode_inputs()
            valid = torch.ones(embeds.shape[:2], dtype=torch.long, device=self._device)
            hidden = any(s.plan.return_hidden_states for s in self._running)
            logits, states = self.forward(self._running_kv, embeds, valid, hidden)
            emit_tokens(self._running, list(range(len(self._running))), logits, states, outbox)
        return outbox

    def free(self, gone: Sequence[TextRequest]) -> None:
        leaving = set(gone)
        for rows, kv in ((self._prefilling, self._prefill_kv), (self._running, self._running_kv)):
            keep = [i for i, s in enumerate(rows) if s not in leaving]
            if len(keep) != len(rows):
                kv.select(keep)
                rows[:] = [rows[i] for i in keep]

    def reset(self) -> None:
        self._prefilling, self._running = [], []
        self._prefill_kv, self._running_kv = KvCache(self._shape), KvCache(self._shape)

    # -- rows -------------------------------------------------------------------

    def _prefill_inputs(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The next chunk of every prefilling row: embeds [rows, W, hidden], valid
        [rows, W] (left padding), and which rows read their last prompt token in it."""
        rows = self._prefilling
        width = min(chunk, max(s.remaining_prompt for s in rows))
        embeds = torch.zeros(
            len(rows), width, self._hidden_size, dtype=self._dtype, device=self._device
        )
        valid = torch.zeros(len(rows), width, dtype=torch.long, device=self._device)
        for i, request in enumerate(rows):
            count = min(request.remaining_prompt, width)
            embeds[i, width - count :] = request.prompt_chunk(count, self._embed)
            valid[i, width - count :] = 1
        return embeds, valid, [i for i, s in enumerate(rows) if s.remaining_prompt == 0]

    def _decode_inputs(self) -> torch.Tensor:
        """Each running row's last token, embedded: [rows, 1, hidden]."""
        ids = torch.tensor([[s.last_token] for s in self._running], device=self._device)
        return self._embed(ids)

    def _after_prefill(
        self,
        done: list[int],
        logits: torch.Tensor,
        states: torch.Tensor | None,
        outbox: Outbox[TextRequest],
    ) -> None:
        """First tokens for the rows whose prompt completed; they move to the
        decoding rows (those their first token did not end)."""
        if not done:
            return
        rows = self._prefilling
        emit_tokens(rows, done, logits, states, outbox)
        moving = [i for i in done if not rows[i].finished]
        self._running_kv.concat(self._prefill_kv.take(moving))
        self._running.extend(rows[i] for i in moving)
        keep = [i for i, s in enumerate(rows) if s.remaining_prompt > 0]
        self._prefilling = [rows[i] for i in keep]
        self._prefill_kv.select(keep)

    def _shared_prefix(
        self, admitted: Sequence[TextRequest]
    ) -> tuple[list[TextRequest], list[TextRequest]]:
        """Requests admitted together whose prompts start alike run that prefix once
        and copy its rows; returns them and the rest. Their own tokens (at least the
        last one) still go through prefill."""
        ids = [s for s in admitted if s.plan.embeds is None]
        if len(ids) < 2:
            return [], list(admitted)
        prompts = [s.plan.token_ids for s in ids]
        length = min(len(p) for p in prompts) - 1
        for column in range(length):
            if any(p[column] != prompts[0][column] for p in prompts[1:]):
                length = column
                break
        if length < MIN_SHARED_PREFIX:
            return [], list(admitted)
        shared = KvCache(self._shape, rows=1)
        embeds = ids[0].prompt_chunk(length, self._embed)[None]
        valid = torch.ones(1, length, dtype=torch.long, device=self._device)
        self.forward(shared, embeds, valid, hidden=False)
        shared.repeat(len(ids))
        for request in ids[1:]:
            request.prefilled = length
        self._prefill_kv.concat(shared)
        return ids, [s for s in admitted if s.plan.embeds is not None]
