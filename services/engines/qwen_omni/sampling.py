"""How the talker draws a step's codes, as the monolithic ``generate`` does: its first
codebook after the repetition penalty (over the codes it drew before) and with the
top 1024 ids suppressed but the end; greedy at temperature 0, else sampled with its
temperature, top-k and top-p, each request from its own generator. The code
predictor's residual codes follow: greedy with a greedy talker, else sampled with
top-k 50 and top-p 0.8 (the model's own settings)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engines.sampling import Sampling, sample

PREDICTOR = Sampling(temperature=1.0, top_p=0.8, top_k=50)


@dataclass(frozen=True)
class CodeSampling:
    first: Sampling
    repetition_penalty: float
    suppress: torch.Tensor  # bool [vocab]: ids never drawn
    generator: torch.Generator

    def token(self, scores: torch.Tensor) -> int:
        """The first codebook's next code from ``scores`` (``scores`` of its logits)."""
        return sample(scores, self.first, self.generator)

    def scores(self, logits: torch.Tensor, drawn: list[int]) -> torch.Tensor:
        """The talker's logits [vocab] as the code is drawn from them: the repetition
        penalty over the codes ``drawn`` before, the suppressed ids at -inf."""
        scores = logits.clone()
        if drawn and self.repetition_penalty != 1.0:
            seen = torch.tensor(drawn, device=scores.device)
            score = scores.gather(0, seen)
            score = torch.where(score < 0, score * self.repetition_penalty,
                                score / self.repetition_penalty)  # fmt: skip
            scores.scatter_(0, seen, score)
        return torch.where(self.suppress, -float("inf"), scores)

    def residual(self, logits: torch.Tensor) -> int:
        """A residual code from the code predictor's logits [codebook]."""
        if self.first.greedy:
            return int(logits.argmax())
        return sample(logits, PREDICTOR, self.generator)
