"""Softmax-family variants through PyTorch's fused ``scaled_dot_product_attention``.

``softmax(c_i q.k)`` with a per-row scale ``c_i`` equals SDPA on ``q_i * c_i`` with ``scale=1``, so
softmax, Scalable-Softmax (``c_i = s_h ln N_i / sqrt(d)``) and softmax-qknorm-logn
(``c_i = ln d ln N_i`` on normalised q, k) all run on SDPA's fused, memory-efficient kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lssar.ops.common import combined_mask, compute_dtype, length_scale, unit, visible_counts


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant,
    options,
) -> Tensor:
    """Softmax-family attention on SDPA; same contract as the reference. ``(B, H_q, T_q, D_v)``."""
    t_q, t_k, d = query.shape[-2], key.shape[-2], query.shape[-1]
    dtype = query.dtype
    if variant.qk_norm:  # normalised (and scaled below) in float32, then back to the input dtype
        query, key = unit(query), unit(key).to(dtype)
    # causal with T_q = T_k stays SDPA's is_causal (fused, O(T) memory), also with a row scale
    fused_causal = attn_mask is None and (not is_causal or t_q == t_k)
    mask = None if fused_causal else combined_mask(attn_mask, is_causal, t_q, t_k, query.device)
    if variant.scaling != "sdpa":
        n = visible_counts(attn_mask, is_causal, t_q, t_k, query.device)
        n = n.to(compute_dtype(query.dtype))
        if variant.scaling == "log_n":
            c = length_scale(n, d)
        else:  # ssmax
            s_h = torch.as_tensor(options["s"], dtype=n.dtype, device=query.device)
            s_h = s_h.reshape(1, -1, 1, 1) if s_h.dim() == 1 else s_h
            base = 1.0 / math.sqrt(d) if scale is None else scale
            c = s_h * torch.log(n.clamp_min(1.0)) * base
        query = (query.to(c.dtype) * c).to(dtype)
        scale = 1.0
    query = query.to(dtype)
    if mask is None:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            None,
            dropout_p,
            fused_causal and is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    # SDPA gives NaN for rows with no visible key: let them see everything, then zero them.
    empty = ~mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        query, key, value, mask | empty, dropout_p, False, scale=scale, enable_gqa=enable_gqa
    )
    return out.masked_fill(empty, 0.0)
