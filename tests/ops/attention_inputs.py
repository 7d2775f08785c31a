"""Random attention inputs shared by the tests of the attention core."""

from __future__ import annotations

import torch


def _inputs(shape, dtype, seed=0):
    b, hq, hkv, tq, tk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]
