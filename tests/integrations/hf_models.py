"""Tiny Hugging Face models and batches shared by the tests of lssar.integrations.hf."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    Qwen2Config,
)

ATOL = 1e-5


FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny(family: str, attn: str, seed: int = 0, **extra) -> torch.nn.Module:
    """2 layers, hidden 64, 4 heads, 2 KV heads (GQA), vocab 256, float32, eval mode."""
    cfg = FAMILIES[family](
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def ragged(lengths=(5, 8, 3), seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g) for n in lengths]


def pad(seqs: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (B, T), mask (B, T))`` with pad id 0 on the left or the right."""
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(t - len(s), t) if left else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    return ids, mask


# ---------------------------------------------------- packed sequences and sliding windows


def flattened(seqs: list[torch.Tensor], **kw) -> dict:
    """transformers' padding-free batch: the sequences in one row, labels -100 at each start."""
    return DataCollatorWithFlattening(**kw)([{"input_ids": s.tolist()} for s in seqs])
