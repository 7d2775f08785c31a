"""Packed sequences as transformers hands them over, read as lssar's ``cu_seqlens``.

transformers packs a batch without padding (``DataCollatorWithFlattening``: the sequences
concatenated into one row) and says where each sequence starts in one of two ways, which its
``flash_attention_2`` path reads (``modeling_flash_attention_utils``):

- FlashAttention's varlen kwargs ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (with ``max_length_q`` /
  ``max_length_k``, which lssar does not need: it reads the lengths from the boundaries), from
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, forwarded by the model to its
  attention function;
- ``position_ids`` that restart inside a row (the collator's default: each sequence counts from
  0). A new sequence starts wherever a position is not its predecessor's plus one, the rule of
  transformers' masks (``masking_utils.find_packed_sequence_indices``); for the collator's
  output it is also flash's (a restart at the smallest position).

Both give boundaries along the batch flattened into one row of ``B * T`` tokens, FlashAttention's
layout; :func:`flatten` / :func:`unflatten` move ``(B, H, T, D)`` tensors to and from that row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def documents(
    kwargs: dict[str, Any], batch: int, t_q: int, t_k: int
) -> tuple[Tensor, Tensor] | None:
    """``(cu_seqlens, cu_seqlens_k)`` of a packed batch (int ``(n_docs + 1,)`` each, along
    ``batch`` rows flattened into one), or None when it is not packed.

    Reads ``cu_seq_lens_q`` / ``cu_seq_lens_k`` from ``kwargs`` if given, else ``position_ids``
    ``(B|1, T_q)`` (a restart inside a row). Packed ``position_ids`` with ``T_k != T_q`` (a KV
    cache holding earlier tokens) are a ``ValueError``: the documents of the cached keys are
    unknown."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None:
            raise ValueError("cu_seq_lens_k needs cu_seq_lens_q (the queries' boundaries)")
        return cu_q, cu_q if cu_k is None else cu_k
    pos = kwargs.get("position_ids")
    if not isinstance(pos, Tensor) or pos.dim() != 2 or pos.shape[-1] != t_q or t_q < 2:
        return None  # decoding one token, or positions of another form (e.g. multimodal)
    starts = torch.ones(pos.shape, dtype=torch.bool, device=pos.device)  # (B|1, T)
    starts[:, 1:] = pos.diff(dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    if t_k != t_q:
        raise ValueError(
            f"position_ids restart inside a row (packed sequences) but the keys ({t_k}) are not "
            f"the queries ({t_q}): a KV cache holds earlier tokens whose sequences are unknown; "
            "run packed batches without a cache, or pass cu_seq_lens_q / cu_seq_lens_k"
        )
    first = starts.expand(batch, -1).reshape(-1).nonzero().squeeze(1)  # (n_docs,)
    cu = torch.cat([first, first.new_tensor([batch * t_q])])
    return cu, cu


def flatten(x: Tensor) -> Tensor:
    """``(B, H, T, D)`` -> ``(1, H, B T, D)``: the rows one after another."""
    b, h, t, d = x.shape
    return x.transpose(0, 1).reshape(1, h, b * t, d)


def unflatten(x: Tensor, batch: int) -> Tensor:
    """``(1, H, B T, D)`` -> ``(B, H, T, D)``, the inverse of :func:`flatten`."""
    _, h, bt, d = x.shape
    return x.reshape(h, batch, bt // batch, d).transpose(0, 1)


def mask_rule(fn: Any) -> set[str] | None:
    """What a transformers mask function (``masking_utils``) asks for, in the terms of
    :func:`lssar.attention`'s own arguments: a subset of ``{"causal", "window", "packed"}``
    (``is_causal``, ``window``, ``cu_seqlens``; ``"remapped"`` marks a rule applied to positions
    within each document, which equals it only beside ``"packed"``), or None when it holds
    anything else (padding is passed beside it; chunked attention, image-token overlays, custom
    functions: None).

    Recognises ``causal_mask_function``, ``and_masks`` of recognised parts,
    ``sliding_window_overlay``, ``packed_sequence_mask_function`` and
    ``remap_positions_for_packed_sequence`` by name and closure, so a change in transformers can
    only make this None, and the caller then builds the mask (correct, just O(T^2))."""
    from transformers.masking_utils import causal_mask_function

    if fn is causal_mask_function:
        return {"causal"}
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
    name = getattr(fn, "__qualname__", "")
    if name == "and_masks.<locals>.and_mask":
        parts = [mask_rule(f) for f in cells.get("mask_functions", ())]
        return None if not parts or None in parts else set().union(*parts)
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        inner = mask_rule(cells.get("mask_function"))  # on positions within each document,
        return None if inner is None else inner | {"remapped"}  # the same rule beside "packed"
    if name == "sliding_window_overlay.<locals>.inner_mask":
        return {"window"}
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return {"packed"}
    return None
