"""Readable, materialised (T_q x T_k) implementations of every variant: the ground truth.

Each variant is two stages (docs/method.md sections 3-4):

1. ``normalise``: scores -> non-negative weights ``a = phi(s) * M``, l1-normalised to ``A`` when the
   variant is normalised;
2. ``reweight`` (optional, any l1 variant): ``x = ReLU(N_i A - O_i)`` with ``O_i = 1`` for
   ``N_i > REWEIGHT_MIN_KEYS`` (3) else 0, ``P = x^p / sum_j x^p``. Computed as
   ``r = x / max_j x`` first: the same weights, but ``x^p`` can neither overflow nor underflow a
   whole row. A row whose ``x`` are all 0 (every visible weight equal, up to rounding:
   ``max x <= uniform_tolerance``) falls back to ``A``.

Memory is O(T_q T_k); use it for checking and for short sequences. See ``lssar.ops.common`` for
the mask, GQA and KV-cache conventions shared by all implementations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lssar.ops.common import (
    alibi_bias,
    as_4d,
    centred_rows,
    combined_mask,
    compute_dtype,
    expand_kv,
    length_scale,
    log_phi,
    uniform_tolerance,
    unit,
    visible_counts,
)
from lssar.ops.spans import KeySpans, span_counts
from lssar.ops.variants import Variant


def scores(
    q: Tensor, k: Tensor, n: Tensor, variant: Variant, scale: float | None, options: dict[str, Any]
) -> Tensor:
    """Scores ``s_ij = c_i q_i.k_j (B,H,T_q,T_k)`` of ``q (B,H,T_q,D)``, ``k (B,H,T_k,D)``."""
    d = q.shape[-1]
    if variant.qk_norm:
        q, k = unit(q), unit(k)
    s = q @ k.transpose(-1, -2)  # (B, H, T_q, T_k)
    if variant.scaling == "log_n":
        return s * length_scale(n, variant.scale_dim(d, options))
    if variant.scaling == "const":  # ln(d) ln(n) for every row, times a learned s_h if any
        c = variant.const_scale(d, options)
        return s * (c if "s" not in options else _per_head(options["s"], s) * c)
    base = 1.0 / math.sqrt(d) if scale is None else scale
    if variant.scaling == "ssmax":
        return s * (_per_head(options["s"], s) * torch.log(n.clamp_min(1.0)) * base)
    return s * base


def _per_head(s_h: Any, like: Tensor) -> Tensor:
    """A float or a per-head ``(H,)`` scale as a tensor broadcasting over ``(B, H, T_q, T_k)``."""
    s_h = torch.as_tensor(s_h, dtype=like.dtype, device=like.device)
    return s_h.reshape(-1, 1, 1) if s_h.dim() == 1 else s_h  # (H, 1, 1) per head


def normalise(
    s: Tensor, mask: Tensor | None, n: Tensor, variant: Variant, options: dict[str, Any]
) -> Tensor:
    """Stage 1: weights ``(B, H, T_q, T_k)``; masked entries and fully masked rows are 0."""
    visible = torch.ones_like(s, dtype=torch.bool) if mask is None else mask.expand_as(s)
    if variant.phi == "exp":
        s = s.masked_fill(~visible, float("-inf"))  # exp(-inf) = 0 keeps masked grads finite
        row_max = s.amax(-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        a = torch.exp(s - row_max)
    elif variant.phi in ("softplus", "sigmoid"):
        if variant.phi == "sigmoid":
            bias = options.get("bias")
            s = s + (-torch.log(n.clamp_min(1.0)) if bias is None else bias)
        # relative to the row's largest weight: cannot underflow (docs/method.md section 5)
        if variant.l1:
            ls = log_phi(s, variant.phi).masked_fill(~visible, float("-inf"))
            row_max = ls.amax(-1, keepdim=True)
            a = torch.exp(
                ls - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
            )
        else:
            a = torch.sigmoid(s) if variant.phi == "sigmoid" else F.softplus(s)
    elif variant.phi == "relu":
        a = F.relu(s)
    else:
        raise AssertionError(variant.phi)
    a = torch.where(visible, a, torch.zeros_like(a))
    if variant.divide_by_n:
        a = a / n.clamp_min(1.0).to(a.dtype)
    if not variant.l1:
        return a
    z = a.sum(-1, keepdim=True)
    return a / torch.where(z > 0, z, torch.ones_like(z))


def reweight(weights: Tensor, n: Tensor, p: float) -> Tensor:
    """Stage 2 (LSSAR re-weighting) of l1-normalised ``weights (B, H, T_q, T_k)``."""
    n = n.to(weights.dtype)
    offset = centred_rows(n).to(weights.dtype)  # O_i
    x = F.relu(n * weights - offset)
    x_max = x.amax(-1, keepdim=True)
    has_mass = x_max > uniform_tolerance(x.dtype) * offset  # x is relative to the row mean
    r = x / torch.where(has_mass, x_max, torch.ones_like(x_max))  # in [0, 1]
    pos = r > 0  # r**p has an unbounded derivative at 0 when p < 1: keep it out of the graph
    w = torch.where(pos, torch.where(pos, r, torch.ones_like(r)) ** p, torch.zeros_like(r))
    sharpened = w / torch.where(has_mass, w.sum(-1, keepdim=True), torch.ones_like(x_max))
    return torch.where(has_mass, sharpened, weights)


def attention_weights(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant: Variant,
    options: dict[str, Any],
    alibi_slopes: Tensor | None = None,
    spans: KeySpans | None = None,
) -> Tensor:
    """Final attention weights ``(B, H, T_q, T_k)`` in the compute dtype (float32/float64).

    ``alibi_slopes`` (``(H,)`` or ``(B, H)``) adds ALiBi's bias ``-slope |pos_i - j|`` to the
    scores after their scale (bottom-right aligned positions, :func:`alibi_bias`). ``spans``
    (documents, a window; the causal rule folded in) become a dense mask here."""
    dtype = compute_dtype(query.dtype)
    t_q, t_k = query.shape[-2], key.shape[-2]
    if enable_gqa:
        key, _ = expand_kv(query, key, key)
    q, k = query.to(dtype), key.to(dtype)
    if spans is None:
        mask = combined_mask(attn_mask, is_causal, t_q, t_k, q.device)
        n = visible_counts(attn_mask, is_causal, t_q, t_k, q.device).to(dtype)
        q_pos = torch.arange(t_q, device=q.device) + t_k - t_q
    else:
        attn_mask = as_4d(attn_mask)
        mask = spans.dense() if attn_mask is None else (attn_mask & spans.dense())
        n, q_pos = span_counts(spans, attn_mask).to(dtype), spans.pos
    s = scores(q, k, n, variant, scale, options)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, q_pos, t_k, dtype)
    w = normalise(s, mask, n, variant, options)
    p = options.get("p")
    return w if p is None else reweight(w, n, p)


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant: Variant,
    options: dict[str, Any],
    alibi_slopes: Tensor | None = None,
    spans: KeySpans | None = None,
) -> Tensor:
    """Materialised attention ``(B, H_q, T_q, D_v)``; dropout (if any) acts on the final weights."""
    w = attention_weights(
        query,
        key,
        attn_mask,
        is_causal,
        scale,
        enable_gqa,
        variant=variant,
        options=options,
        alibi_slopes=alibi_slopes,
        spans=spans,
    )
    if dropout_p > 0:
        w = F.dropout(w, dropout_p, training=True)
    if enable_gqa:
        _, value = expand_kv(query, value, value)
    return (w @ value.to(w.dtype)).to(query.dtype)
