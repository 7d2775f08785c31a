"""The tiny float64 GPT shared by the tests of lssar.model."""

from __future__ import annotations

import torch

from lssar.model import GPT, GPTConfig


def _model(attn: str, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, attn=attn, **kw)
    return GPT(cfg).double().eval()
