"""The Qwen3-Omni thinker as a model runner under the shared scheduler: a prompt with
images or audio prefilled alone (its encoders run once, its 3D positions its own),
the prompts of text alone that arrive together prefilled in one forward
(right-padded: one read of the weights for all of them); every running request
decoded together, one token a step, from one padded KV cache (rows.py).

Per request it emits its tokens, and for the talker (``handoff``): after its prefill,
the prompt's hidden states of layer 0 and of the talker's accept layer, the prompt
ids, the tts embeddings and the media grids, as one tokenless segment; then with
each token its layer-0 row (the token's embedding: what the talker reads of the
answer), as per-token "hidden_states" the edge's windows split with the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engines.base import (
    EngineEvent,
    FinishOutput,
    FinishReason,
    ProgressOutput,
    TensorOutput,
    TokenOutput,
)
from services.engines.detokenizer import IncrementalDetokenizer
from services.engines.hf_cache import cache_argument, transformers_cache
from services.engines.kv_cache import KvCache, KvShape
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni.rows import OmniRunner, prompt_positions, right_padded
from services.engines.sampling import Sampling, sample
from services.engines.scheduler import Handed, Outbox, Step


@dataclass(eq=False)
class ThinkerRequest:
    """One thinker request under the scheduler."""

    request_id: str
    inputs: dict[str, torch.Tensor]  # the processor's, on the model's device
    max_tokens: int
    sampling: Sampling
    generator: torch.Generator
    eos: int
    handoff: bool
    text: IncrementalDetokenizer  # the text new tokens add, from the last few alone
    deliver: Any
    submitted: float
    admitted: float = 0.0
    cancelled: bool = False
    finished: bool = False
    answer: list[int] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    @property
    def remaining_prompt(self) -> int:
        return 0 if self.answer else self.prompt_tokens

    @property
    def text_only(self) -> bool:
        """A prompt of text alone (no media encoders, 1D positions): prefilled with others."""
        return set(self.inputs) <= {"input_ids", "attention_mask"}

    @property
    def ready(self) -> bool:
        return True

    def add(self, token: int, row: torch.Tensor | None) -> list[Handed]:
        self.answer.append(token)
        events: list[Handed] = [TokenOutput((token,), self.text.add(token), row)]
        reason: FinishReason | None = None
        if token == self.eos:
            reason = "eos"
        elif len(self.answer) >= self.max_tokens:
            reason = "length"
        if reason is not None:
            self.finished = True
            if tail := self.text.flush():  # an incomplete character at the end
                events.append(TokenOutput((), tail))
            events.append(FinishOutput(reason, self.prompt_tokens, len(self.answer)))
        return events


# Prompt positions (rows x the longest prompt) one prefill forward of prompts of
# text alone may take: bounds its activations (a request's prompt is already bounded
# by the stage's max_prompt_tokens).
PREFILL_CELLS = 8192


class ThinkerRunner(OmniRunner[ThinkerRequest]):
    def __init__(self, model: Any, config: Any) -> None:
        self.model = model  # Qwen3OmniMoeThinkerForConditionalGeneration
        self._config = config
        self._text_config = model.config.text_config
        device = next(model.parameters()).device
        super().__init__(KvShape.of(self._text_config, model.dtype, device))
        self._embed = model.get_input_embeddings()
        self._accept = config.talker_config.accept_hidden_layer
        self._tts = torch.tensor(
            [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
            device=device,
        )
        self._cache_argument = cache_argument(type(model.model).forward)
        # Called with each request's logits before its token is drawn (tests: how far
        # batching moves them, how close a choice was).
        self.watch: Callable[[str, torch.Tensor], None] | None = None
        self.prefills: list[int] = []  # rows per prefill forward, the last few (tests)

    # -- the scheduler's ModelRunner -------------------------------------------

    def run(self, step: Step[ThinkerRequest]) -> Outbox[ThinkerRequest]:
        outbox: Outbox[ThinkerRequest] = {}
        together = [r for r in step.prefill if r.text_only]
        if len(together) < 2:  # one alone runs as the model's own generate would
            together = []
        for request in step.prefill:
            if request not in together:
                self._prefill(request, outbox)
        for batch in self._batches(together):
            self._prefill_together(batch, outbox)
        if step.decode:
            self._decode(step.decode, outbox)
        return outbox

    # -- forwards ---------------------------------------------------------------

    def _forward(self, kv: KvCache, positions: torch.Tensor, hidden: bool, **inputs: Any) -> Any:
        width = positions.shape[-1]
        kv.reserve(width)
        out = self.model.model(
            **inputs, position_ids=positions, use_cache=True, output_hidden_states=hidden,
            **{self._cache_argument: transformers_cache(kv, self._text_config)},
        )  # fmt: skip
        return out

    def _prefill(self, request: ThinkerRequest, outbox: Outbox[ThinkerRequest]) -> None:
        inputs = request.inputs
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        audio = inputs.get("feature_attention_mask")
        rotary, delta = self.model.model.get_rope_index(
            ids, inputs.get("image_grid_thw"), None, mask, False,
            None if audio is None else audio.sum(dim=1), None,
        )  # fmt: skip
        kv = KvCache(self._shape, rows=1)
        self.prefills = [*self.prefills[-255:], 1]
        out = self._forward(kv, prompt_positions(rotary), request.handoff, **inputs)
        kv.extend(mask)
        # The whole prompt's logits, as the model's own generate takes them (the last
        # row of a product over every position can differ in its last bits from a
        # product over that row alone).
        logits = self.model.lm_head(out.last_hidden_state)[0, -1].float()
        events: list[Handed] = []
        if request.handoff:
            hidden = out.hidden_states
            events += self._handoff(request, hidden[0][0], hidden[self._accept][0])
        events += self._take(request, logits)
        outbox[request] = events
        if not request.finished:
            self.rows.join([request], kv, [int(delta)])

    def _batches(self, requests: list[ThinkerRequest]) -> list[list[ThinkerRequest]]:
        """``requests`` in groups whose padded prompts fit one forward (PREFILL_CELLS)."""
        batches: list[list[ThinkerRequest]] = []
        for request in sorted(requests, key=lambda r: r.prompt_tokens):
            batch = batches[-1] if batches else None
            width = request.prompt_tokens  # the longest so far: sorted by length
            if batch is None or width * (len(batch) + 1) > PREFILL_CELLS:
                batches.append([request])
            else:
                batch.append(request)
        return batches

    def _prefill_together(
        self, requests: Sequence[ThinkerRequest], outbox: Outbox[ThinkerRequest]
    ) -> None:
        """Prompts of text alone in one forward, right-padded; each row's outputs as
        its prompt alone would give them, up to the product's rounding."""
        ids = right_padded([r.inputs["input_ids"][0] for r in requests])
        mask = right_padded([r.inputs["attention_mask"][0] for r in requests])
        rotary, deltas = self.model.model.get_rope_index(ids, None, None, mask, False, None, None)
        kv = KvCache(self._shape, rows=len(requests))
        self.prefills = [*self.prefills[-255:], len(requests)]
        handoff = any(r.handoff for r in requests)
        out = self._forward(kv, prompt_positions(rotary), handoff, input_ids=ids,
                            attention_mask=mask)  # fmt: skip
        kv.extend(mask)
        logits = self.model.lm_head(out.last_hidden_state).float()
        joining, at = [], []
        for row, request in enumerate(requests):
            length = request.prompt_tokens
            events: list[Handed] = []
            if request.handoff:
                hidden = out.hidden_states
                events += self._handoff(
                    request, hidden[0][row, :length], hidden[self._accept][row, :length]
                )
            events += self._take(request, logits[row, length - 1])
            outbox[request] = events
            if not request.finished:
                joining.append(request)
                at.append(row)
        if joining:
            kv.select(at)
            self.rows.join(joining, kv, [int(deltas[row]) for row in at])

    def _decode(self, stepping: Sequence[ThinkerRequest], outbox: Outbox[ThinkerRequest]) -> None:
        rows = self.rows
        assert len(stepping) == len(rows), "a thinker steps all its rows"
        ids = torch.tensor([[r.answer[-1]] for r in rows.requests], device=self._shape.device)
        valid = torch.ones_like(ids)
        out = self._forward(
            rows.kv, rows.positions(valid), False, input_ids=ids,
            attention_mask=torch.cat([rows.kv.mask, valid], dim=1),
        )  # fmt: skip
        rows.kv.extend(valid)
        logits = self.model.lm_head(out.last_hidden_state[:, -1]).float()
        for row, request in enumerate(rows.requests):
            outbox[request] = self._take(request, logits[row])

    def _take(self, request: ThinkerRequest, logits: torch.Tensor) -> list[Handed]:
        """The request's next token from its logits, and the events it makes."""
        if self.watch is not None:
            self.watch(request.request_id, logits)
        try:
            token = sample(logits, request.sampling, request.generator)
        except RuntimeError as exc:  # its logits hold NaN or inf: this request's alone
            request.finished = True
            request.deliver(exc)
            return []
        row = None
        if request.handoff:
            with torch.no_grad():
                embed = self._embed(torch.tensor([token], device=self._shape.device))
            row = embed.to("cpu", copy=True)
        return request.add(token, row)

    def _handoff(
        self, request: ThinkerRequest, layer0: torch.Tensor, accept: torch.Tensor
    ) -> list[EngineEvent]:
        """The prompt's part of the talker's hand-off (its hidden states of layer 0 and
        of the accept layer, [S, H] each), flushed as its own segment."""
        inputs = request.inputs
        with torch.no_grad():
            tts = self._embed(self._tts)
        tensors = {
            names.PROMPT_HIDDEN: torch.stack((layer0, accept), dim=1).cpu(),
            names.PROMPT_IDS: inputs["input_ids"][0].cpu(),
            names.TTS_EMBEDS: tts.cpu(),
        }
        if "image_grid_thw" in inputs:
            tensors[names.IMAGE_GRID] = inputs["image_grid_thw"].cpu()
        if "feature_attention_mask" in inputs:
            tensors[names.AUDIO_LENGTHS] = inputs["feature_attention_mask"].sum(dim=1).cpu()
        return [TensorOutput(tensors), ProgressOutput(step=0, total_steps=request.max_tokens)]
