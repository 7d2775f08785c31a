"""Random attention inputs and key-padding masks shared by the tests of the attention core."""

from __future__ import annotations

import torch


def _inputs(shape, dtype, seed=0):
    b, hq, hkv, tq, tk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _padding_mask(shape, seed=0):
    b, _, _, tq, tk, _ = shape
    g = torch.Generator().manual_seed(seed + 1)
    m = torch.rand(b, 1, tq, tk, generator=g) > 0.3
    m[:, :, tq // 2] = False  # one fully masked row
    return m
