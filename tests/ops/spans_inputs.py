"""Inputs, document boundaries and the triton marker shared by the tests of packed documents,
windows and sinks."""

from __future__ import annotations

import os

import pytest
import torch

import lssar
from lssar.ops import registry

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# triton runs here: on a GPU, or interpreted (conftest.py sets the variable before triton loads)
TRITON = "triton" in registry.IMPLS and (
    DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
)


# documents of lengths that split 7-row (chunked) and 16-row (interpreted triton) blocks, with a
# 1-token and an empty document
DOCS = [5, 17, 1, 0, 40]


needs_triton = pytest.mark.skipif(
    not TRITON, reason="needs triton on a GPU or with TRITON_INTERPRET=1"
)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(t_q, t_k, dtype=torch.float32, b=2, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, t_k, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, t_k, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _run(q, k, v, grad, **kw):
    if kw.get("impl") == "triton" and DEVICE != "cpu":  # on the GPU; results back on the CPU
        if kw.get("attn_mask") is not None:
            kw["attn_mask"] = kw["attn_mask"].to(DEVICE)
        out = lssar.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), **kw).cpu()
    else:
        out = lssar.attention(q, k, v, **kw)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]
