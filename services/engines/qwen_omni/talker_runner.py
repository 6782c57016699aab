"""The Qwen3-Omni talker as a model runner under the shared scheduler: a generation
loop of our own (the monolithic ``talker.generate``'s steps, line for line), so that
many requests share each forward and a request can start before its thinker is done.

A request prefills once the thinker's prompt part and first token are there (its
prompt from handoff.py): alone when its prompt holds media (its 3D positions), with
the others of its step that hold none otherwise (right-padded, one forward). Each
decode step, for every row whose next text row is there (``TalkerRequest.ready``):
the code predictor draws the residual codes of the row's last token for all those
rows together (its own small forward per code group), their embeddings are summed
with the row's text row (the answer's rows projected together), and one talker
forward gives every row its next token. A row whose thinker is
behind takes a padding column instead and waits, without a busy loop: the
scheduler sleeps until its input comes (``Scheduler.wake``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from services.engines.base import FinishOutput, FinishReason, TensorOutput
from services.engines.hf_cache import cache_argument, transformers_cache
from services.engines.kv_cache import KvCache, KvShape
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni.handoff import Handoff, Prompt, talker_prompt, trailing
from services.engines.qwen_omni.rows import OmniRunner, right_padded
from services.engines.qwen_omni.sampling import CodeSampling
from services.engines.scheduler import Handed, Outbox, Step, WindowEnd


@dataclass(eq=False)
class TalkerRequest:
    """One talker request under the scheduler; ``handoff`` grows as the thinker's
    windows come (from the event loop; the model thread reads it at steps)."""

    request_id: str
    handoff: Handoff
    speaker_id: int
    sampling: CodeSampling
    max_tokens: int
    deliver: Any
    submitted: float
    admitted: float = 0.0
    cancelled: bool = False
    finished: bool = False
    prompt: Prompt | None = None
    tokens: list[int] = field(default_factory=list)  # first codebook, as sampled
    steps: int = 0  # decode steps done (the monolithic generation_step)
    last_hidden: torch.Tensor | None = None  # [1, 1, Ht]: the last forward's, last layer

    @property
    def remaining_prompt(self) -> int:
        return 0 if self.prompt is not None else 1

    @property
    def ready(self) -> bool:
        if self.prompt is None:
            return bool(self.handoff.answer_ids)  # the talker's prompt ends with token 0
        return self.handoff.has_row(self.steps)

    @property
    def given(self) -> int:
        """The thinker's answer rows it has (what its WindowEnd counts)."""
        return len(self.handoff.answer_embeds)


class TalkerRunner(OmniRunner[TalkerRequest]):
    def __init__(self, model: Any, config: Any) -> None:
        self.model = model  # Qwen3OmniMoeTalkerForConditionalGeneration
        self._config = config
        self._text_config = model.config.text_config
        self._device = next(model.parameters()).device
        super().__init__(KvShape.of(self._text_config, model.dtype, self._device))
        self._groups = model.config.num_code_groups
        self._eos = model.config.codec_eos_token_id
        self._cache_argument = cache_argument(type(model.model).forward)
        # Called with each request's logits before a code is drawn, the first codebook's
        # (group 0) and the code predictor's (1 ..): tests, as the thinker's.
        self.watch: Callable[[str, int, torch.Tensor], None] | None = None
        self.prefills: list[int] = []  # rows per prefill forward, the last few (tests)

    def run(self, step: Step[TalkerRequest]) -> Outbox[TalkerRequest]:
        outbox: Outbox[TalkerRequest] = {}
        prompts = {r: self._prompt(r) for r in step.prefill}
        together = [r for r, prompt in prompts.items() if not prompt.grids]
        if len(together) < 2:  # one alone runs as the model's own generate would
            together = []
        for request, prompt in prompts.items():
            if request not in together:
                self._prefill(request, prompt, outbox)
        if together:
            self._prefill_together(together, [prompts[r] for r in together], outbox)
        if step.decode:
            self._decode(step.decode, outbox)
        return outbox

    # -- forwards ---------------------------------------------------------------

    def _forward(self, kv: KvCache, embeds: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(logits of every position [rows, W, V] float32, the last layer's [rows, W, Ht])."""
        kv.reserve(embeds.shape[1])
        out = self.model.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
            output_hidden_states=True,
            **{self._cache_argument: transformers_cache(kv, self._text_config)},
        )  # fmt: skip
        logits = self.model.codec_head(out.last_hidden_state).float()
        return logits, out.hidden_states[-1]

    def _prompt(self, request: TalkerRequest) -> Prompt:
        return talker_prompt(self.model, self._config, request.handoff, request.speaker_id)

    def _prefill(
        self, request: TalkerRequest, prompt: Prompt, outbox: Outbox[TalkerRequest]
    ) -> None:
        model = self.model
        embeds = prompt.inputs_embeds
        length = embeds.shape[1]
        mask = torch.ones(1, length, dtype=torch.long, device=self._device)
        if prompt.grids:
            grids = prompt.grids
            rotary, delta = model.get_rope_index(
                prompt.talker_input_ids, grids.get("image_grid_thw"), None, mask, False,
                grids.get("audio_feature_lengths"), None,
            )  # fmt: skip
        else:
            rotary = torch.arange(length, device=self._device).view(1, 1, -1).expand(3, 1, -1)
            delta = torch.zeros(1, 1, dtype=torch.long)
        text = torch.arange(length, device=self._device).view(1, 1, -1)
        kv = KvCache(self._shape, rows=1)
        self.prefills = [*self.prefills[-255:], 1]
        logits, last = self._forward(kv, embeds, torch.cat([text, rotary]), mask)
        kv.extend(mask)
        self._prefilled([request], [prompt], kv, [int(delta)], logits[:, -1], last[:, -1:], outbox)

    def _prefill_together(self, requests: Sequence[TalkerRequest], prompts: Sequence[Prompt],
                          outbox: Outbox[TalkerRequest]) -> None:  # fmt: skip
        """Prompts without media in one forward, right-padded (1D positions, no offset)."""
        lengths = [p.inputs_embeds.shape[1] for p in prompts]
        embeds = right_padded([p.inputs_embeds[0] for p in prompts])
        mask = right_padded([torch.ones(n, dtype=torch.long, device=self._device) for n in lengths])
        positions = torch.arange(embeds.shape[1], device=self._device)
        positions = positions.view(1, 1, -1).expand(4, len(prompts), -1)
        kv = KvCache(self._shape, rows=len(prompts))
        self.prefills = [*self.prefills[-255:], len(prompts)]
        logits, hidden = self._forward(kv, embeds, positions, mask)
        kv.extend(mask)
        ends = torch.tensor(lengths, device=self._device) - 1
        rows = torch.arange(len(prompts), device=self._device)
        last = hidden[rows, ends][:, None]
        self._prefilled(requests, prompts, kv, [0] * len(prompts), logits[rows, ends], last,
                        outbox)  # fmt: skip

    def _prefilled(self, requests: Sequence[TalkerRequest], prompts: Sequence[Prompt],
                   kv: KvCache, deltas: Sequence[int], logits: torch.Tensor, last: torch.Tensor,
                   outbox: Outbox[TalkerRequest]) -> None:  # fmt: skip
        """Prefilled rows (``logits`` [R, V] and ``last`` [R, 1, Ht] at each prompt's
        end): each draws its first code; those going on join the batch."""
        joining: list[TalkerRequest] = []
        at: list[int] = []
        for row, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
            request.prompt, request.last_hidden = prompt, last[row : row + 1]
            outbox[request] = self._take(request, logits[row], codes=None)
            if not request.finished:
                joining.append(request)
                at.append(row)
        if joining:
            kv.select(at)
            self.rows.join(joining, kv, [deltas[row] for row in at])
        for request in joining:
            self._starved(request, outbox)

    def _starved(self, request: TalkerRequest, outbox: Outbox[TalkerRequest]) -> None:
        """Tell a request whose next step must wait for its thinker (its engine ends
        that window there), once per wait."""
        if not request.finished and not request.ready:
            outbox.setdefault(request, []).append(WindowEnd(request.given))

    def _decode(self, stepping: Sequence[TalkerRequest], outbox: Outbox[TalkerRequest]) -> None:
        rows = self.rows
        at = {id(r): i for i, r in enumerate(rows.requests)}
        order = sorted(stepping, key=lambda r: at[id(r)])
        codes = self._residuals(order)  # [R, G]: each row's last token and its residuals
        embeds = torch.zeros(len(rows), 1, self.model.config.text_config.hidden_size,
                             dtype=self.model.dtype, device=self._device)  # fmt: skip
        index = torch.tensor([at[id(r)] for r in order], device=self._device)
        embeds[index] = self._codec_sums(codes) + self._texts(order)
        valid = rows.step_mask(order)
        logits, last = self._forward(
            rows.kv, embeds, rows.positions(valid), torch.cat([rows.kv.mask, valid], dim=1)
        )
        last = last[:, -1:]
        rows.kv.extend(valid)
        for n, request in enumerate(order):
            row = at[id(request)]
            request.steps += 1
            request.last_hidden = last[row : row + 1]
            outbox[request] = self._take(request, logits[row, -1], codes[n : n + 1])
        for request in order:
            self._starved(request, outbox)

    def _texts(self, order: Sequence[TalkerRequest]) -> torch.Tensor:
        """Each row's text input of this step [R, 1, Ht] (``trailing``): the answer's
        rows that are still to come projected in one product, tts_eos / tts_pad after."""
        texts: list[torch.Tensor | None] = []
        answer: list[torch.Tensor] = []
        for request in order:
            assert request.prompt is not None
            text = trailing(request.handoff, request.prompt, request.steps)
            texts.append(text)
            if text is None:
                answer.append(request.handoff.answer_embeds[request.steps + 1])
        if answer:
            rows = torch.stack(answer).to(self._device, self.model.dtype)[:, None]
            projected = iter(self.model.text_projection(rows))
            texts = [next(projected)[None] if t is None else t for t in texts]
        return torch.cat(texts)  # type: ignore[arg-type]

    def _residuals(self, order: Sequence[TalkerRequest]) -> torch.Tensor:
        """The code predictor, all rows together: from each row's last hidden state and
        last token, its num_code_groups - 1 residual codes; [R, G] with the token first."""
        predictor = self.model.code_predictor
        last = torch.tensor([[r.tokens[-1]] for r in order], device=self._device)
        hidden = torch.cat([r.last_hidden for r in order])  # type: ignore[misc]
        embeds = torch.cat((hidden, self.model.get_input_embeddings()(last)), dim=1)
        cache = DynamicCache(config=predictor.config)
        drawn = [last]
        greedy = all(r.sampling.first.greedy for r in order)
        out = predictor(inputs_embeds=embeds, use_cache=True, **{self._cache_argument: cache})
        for group in range(1, self._groups):
            logits = out.logits[:, -1].float()
            if self.watch is not None:
                for n, request in enumerate(order):
                    self.watch(request.request_id, group, logits[n])
            if greedy:  # the same argmax per row as residual()'s, all rows in one
                drawn.append(logits.argmax(dim=-1, keepdim=True))
            else:
                drawn.append(torch.tensor([[r.sampling.residual(logits[n])] for n, r in
                                           enumerate(order)], device=self._device))  # fmt: skip
            if group < self._groups - 1:
                out = predictor(input_ids=drawn[-1], generation_steps=group, use_cache=True,
                                **{self._cache_argument: cache})  # fmt: skip
        return torch.cat(drawn, dim=1)

    def _codec_sums(self, codes: torch.Tensor) -> torch.Tensor:
        """The monolithic loop's next input of each row from its codes [R, G]: the
        token's embedding and each residual's, summed (their order kept): [R, 1, Ht]."""
        tables = self.model.code_predictor.get_input_embeddings()
        parts = [self.model.get_input_embeddings()(codes[:, :1])]
        parts += [tables[k - 1](codes[:, k : k + 1]) for k in range(1, self._groups)]
        return torch.cat(parts, dim=1).sum(1, keepdim=True)

    def _take(self, request: TalkerRequest, logits: torch.Tensor,
              codes: torch.Tensor | None) -> list[Handed]:  # fmt: skip
        """The codes this forward consumed go out; the next token is drawn."""
        events: list[Handed] = []
        scores = request.sampling.scores(logits, request.tokens)
        if self.watch is not None:
            self.watch(request.request_id, 0, scores)
        if codes is not None:
            events.append(TensorOutput({names.CODES: codes.to("cpu", copy=True)}))
        try:
            token = request.sampling.token(scores)
        except RuntimeError as exc:  # its logits hold NaN or inf: this request's alone
            request.finished = True
            request.deliver(exc)
            return []
        request.tokens.append(token)
        if token == self._eos or len(request.tokens) >= request.max_tokens:
            request.finished = True
            prompt_tokens = len(request.handoff.prompt_ids)
            reason: FinishReason = "eos" if token == self._eos else "length"
            events.append(FinishOutput(reason, prompt_tokens, len(request.tokens) - 1))
        return events
