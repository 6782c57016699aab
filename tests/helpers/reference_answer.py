"""What SmolLM2 answers on this machine, computed in this run: the reference a test
compares a stage's answer with, never a literal.

A fixed answer ("Paris") is the CPU's as much as the model's: vLLM's bfloat16 build
on an Intel Xeon answers the same question with something else (issue 38), and any
path that sums in another order may take the other side of a near-tie. So the
reference is plain transformers in float32 on the converted GGUF, greedy; a float64
run of the same tokens says which of its choices float32 rounding could not have
swapped (further apart than a multiple of float32's own error there, the rule of
float_error.assert_same_choices). An answer under test must say exactly the
reference's tokens up to the first choice that is not so decided; after it, the
answers may part.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tests.helpers.float_error import MULTIPLE


@dataclass(frozen=True)
class Reference:
    """A greedy float32 answer, and how much of it no float32 rounding could change."""

    token_ids: tuple[int, ...]
    decided: int  # leading tokens whose choice float32 rounding cannot swap
    complete: bool  # every choice decided, the end included: the whole answer is fixed
    text: str
    decided_text: str  # the text of the decided tokens

    def assert_said(self, token_ids: tuple[int, ...] | list[int]) -> None:
        """``token_ids`` (an answer's tokens, maybe cut short by max_tokens) agree
        with the reference on every decided token they reach."""
        reach = min(self.decided, len(token_ids))
        assert tuple(token_ids[:reach]) == self.token_ids[:reach], (
            f"answer {list(token_ids)} differs from this machine's float32 reference "
            f"{list(self.token_ids)} within its first {self.decided} decided tokens"
        )
        assert len(token_ids) >= min(self.decided, 1), "the answer is empty"

    def assert_text(self, text: str) -> None:
        """The same for an answer heard as text: it starts with the decided text,
        and is the whole reference where every token was decided."""
        if self.complete:
            assert text.strip() == self.text.strip(), (text, self.text)
        else:
            assert text.strip().startswith(self.decided_text.strip()), (text, self.decided_text)


class ReferenceLM:
    """SmolLM2 as plain transformers, float32 for the answer and float64 to judge it."""

    def __init__(self, folder: Path) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.exact = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        self._answers = cache(self._answer)

    def chat_ids(self, question: str) -> list[int]:
        """The prompt a text engine makes of one user message (text_intake._chat)."""
        encoded = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def answer(self, question: str, max_tokens: int) -> Reference:
        """The greedy answer to one user message, at most ``max_tokens`` long."""
        return self._answers(tuple(self.chat_ids(question)), max_tokens)

    def continuation(self, prompt_ids: list[int], max_tokens: int) -> Reference:
        """The greedy continuation of ``prompt_ids`` as they are (no template)."""
        return self._answers(tuple(prompt_ids), max_tokens)

    @torch.inference_mode()
    def _answer(self, prompt_ids: tuple[int, ...], max_tokens: int) -> Reference:
        prompt = list(prompt_ids)
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        answer = out[0, len(prompt) :].tolist()
        eos = self.model.generation_config.eos_token_id
        stops = set(eos if isinstance(eos, list) else [eos])
        if answer and answer[-1] in stops:
            answer = answer[:-1]  # the engines end at it without saying it
            judged = len(answer) + 1  # ending is a choice too
        else:
            judged = len(answer)
        full = torch.tensor([prompt + answer + list(stops)[:1]])[:, : len(prompt) + judged]
        # The logits that chose each answer token (and the end), in both precisions.
        at = slice(len(prompt) - 1, len(prompt) - 1 + judged)
        trusted = self.model(full).logits[0, at].double()
        exact = self.exact(full).logits[0, at]
        worst = (trusted - exact).abs().amax(dim=-1)
        top = exact.topk(2, dim=-1)
        gap = top.values[:, 0] - top.values[:, 1]
        chosen = torch.tensor((answer + list(stops)[:1])[:judged])
        decided_at = (gap > 2 * MULTIPLE * worst) & (top.indices[:, 0] == chosen)
        undecided = (~decided_at).nonzero()
        decided = int(undecided[0]) if len(undecided) else judged
        return Reference(
            token_ids=tuple(answer),
            decided=min(decided, len(answer)),
            complete=decided == judged,
            text=self.tokenizer.decode(answer, skip_special_tokens=True),
            decided_text=self.tokenizer.decode(answer[:decided], skip_special_tokens=True),
        )
