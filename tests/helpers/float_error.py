"""How close a float32 result must be, derived on the machine that runs the test.

oneDNN and MKL pick their kernels by CPU (AVX2, AVX-512, AVX-512 with bf16, AMX), and
each blocks its sums differently: an absolute tolerance fitted on one machine failed on
the next (issue 18). What holds on every machine is relative. Against a float64
reference, a path that does the same sums in another order is about as far off as the
float32 path the test trusts, whatever the kernels are; a wrong weight, layout or row
is off by orders of magnitude more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Packed linears on SmolLM2 (50 rows of logits): 1-2x the plain path's error, up to
# 4.8x on a row where the plain path happens to be unusually accurate. Broken ones:
# noise of 1e-6 on every weight errs 16x; one weight of 211 off by 1e-2, over 1,000x;
# one transposed, about 100,000x.
MULTIPLE = 8.0
FLOAT32_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class RowErrors:
    """Root-mean-square errors against the float64 reference, one per row (the
    first dimension): the path under test, the trusted path, and what is allowed."""

    mine: list[float]
    trusted: list[float]
    allowed: list[float]

    @property
    def ok(self) -> bool:
        return all(m <= a for m, a in zip(self.mine, self.allowed, strict=True))


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean(dim=tuple(range(1, x.dim()))).sqrt()


def row_errors(mine: torch.Tensor, trusted: torch.Tensor, reference: torch.Tensor) -> RowErrors:
    """``mine`` and ``trusted`` (float32) against ``reference`` (float64), row by row.
    Allowed: MULTIPLE times the trusted path's error, plus float32's own resolution
    of the values, for a trusted path that happens to be exact."""
    assert mine.shape == trusted.shape == reference.shape
    exact = reference.to(torch.float64)
    trusted_rms = _rms(trusted.to(torch.float64) - exact)
    allowed = MULTIPLE * trusted_rms + FLOAT32_EPS * _rms(exact)
    return RowErrors(
        _rms(mine.to(torch.float64) - exact).tolist(), trusted_rms.tolist(), allowed.tolist()
    )


def assert_float32_close(
    mine: torch.Tensor, trusted: torch.Tensor, reference: torch.Tensor
) -> None:
    errors = row_errors(mine, trusted, reference)
    assert errors.ok, errors


def assert_same_choices(mine: torch.Tensor, trusted: torch.Tensor, reference: torch.Tensor) -> None:
    """``mine``'s argmax over the last dimension is the reference's wherever the
    reference's top two are too far apart for float32 rounding to swap them: further
    than MULTIPLE times the trusted path's largest error in that row, on each side.
    Near-ties are left out; most positions must be decided (the check is not vacuous)."""
    exact = reference.to(torch.float64)
    worst = (trusted.to(torch.float64) - exact).abs().flatten(1).amax(dim=1)
    top = exact.topk(2, dim=-1).values
    gap = top[..., 0] - top[..., 1]
    decided = gap > 2 * MULTIPLE * worst.view(-1, *[1] * (gap.dim() - 1))
    assert decided.float().mean() >= 0.75, f"{decided.float().mean():.0%} of positions decided"
    agree = mine.argmax(dim=-1) == exact.argmax(dim=-1)
    assert agree[decided].all(), f"{int((~agree[decided]).sum())} decided positions differ"
