"""The accuracy rule every fast path is held to, in one place.

A fast path computing in the inputs' precision may err by ``factor`` x what the materialised
reference in that precision errs (2x forward, 3x gradients), measured against float64. On an
ill-conditioned row (e.g. two keys whose re-weighted scores nearly tie at p = 15) the reference's
own error is a lucky draw, so the allowance is taken from the larger of it and the problem's
conditioning at that precision: how far the float64 answer moves when the inputs are perturbed by
one rounding (relative noise of the dtype's unit roundoff).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def rounding_sensitivity(
    run64: Callable[..., Sequence[Tensor]],
    inputs64: Sequence[Tensor],
    golden: Sequence[Tensor],
    dtype: torch.dtype,
    tries: int = 2,
    seed: int = 0,
) -> list[float]:
    """Per output, the largest float64 change under ``tries`` one-rounding input perturbations."""
    u = torch.finfo(dtype).eps / 2
    g = torch.Generator().manual_seed(seed)
    worst = [0.0] * len(golden)
    for _ in range(tries):
        moved = []
        for t in inputs64:
            noise = (torch.rand(t.shape, generator=g, dtype=torch.float64) * 2 - 1) * u
            moved.append((t.detach() * (1 + noise)).requires_grad_(t.requires_grad))
        for i, (o, ref) in enumerate(zip(run64(*moved), golden)):
            worst[i] = max(worst[i], err(o, ref))
    return worst


def assert_within_rule(fast, ref, golden, sensitivity, atol_rel: float = 2e-6) -> None:
    """``fast`` (outputs then gradients) within the rule against ``golden`` (see module doc)."""
    for i, (f, r, g, s) in enumerate(zip(fast, ref, golden, sensitivity)):
        factor = 2.0 if i == 0 else 3.0
        allowed = factor * max(err(r, g), s) + atol_rel * (g.abs().max().item() + 1.0)
        assert torch.isfinite(f).all(), i
        assert err(f, g) <= allowed, (i, err(f, g), err(r, g), s)
