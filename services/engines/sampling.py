"""Choosing the next token from one row of logits (the text engines and the Qwen3-Omni thinker)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters with the stage defaults filled in."""

    temperature: float
    top_p: float
    top_k: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's top token, ``logits`` [rows, vocab]: torch's argmax (the first of
    equal maxima; NaN above all), by numpy's on the CPU. torch's reduction over one
    row of a 49k vocabulary took 50-150 us (a parallel region for a few thousand
    floats), numpy's ~5: a decode step's share of a 10 ms token."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64):
        return logits.argmax(dim=-1).tolist()  # type: ignore[no-any-return]
    return logits.detach().numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token id from ``logits`` [vocab] (float32)."""
    if sampling.greedy:
        return int(logits.argmax())
    # Scaled from the top logit down: a tiny temperature then sends the others to
    # -inf (a greedy pick) rather than every logit to +-inf and the softmax to NaN.
    logits = (logits - logits.max()) / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p; the
        # first token always survives.
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
