"""Softmax-family variants through PyTorch's fused ``scaled_dot_product_attention``.

``softmax(c_i q.k)`` with a per-row scale ``c_i`` equals SDPA on ``q_i * c_i`` with ``scale=1``, so
softmax, Scalable-Softmax (``c_i = s_h ln N_i / sqrt(d)``) and softmax-qknorm-logn
(``c_i = ln d ln N_i`` on normalised q, k) all run on SDPA's fused, memory-efficient kernels.

With ``alibi_slopes`` the scores get ALiBi's bias ``-slope_h |pos_i - j|`` (after the scale). A
bias is a float mask, which SDPA takes only materialised, so the queries run in blocks of rows
with one float bias per block (``(B|1, H, block, T_k)``, never ``T_q x T_k``; a causal block
reads only the keys it can see); a backward through several blocks recomputes each block's bias
instead of keeping it (activation checkpointing), so training memory is bounded the same way.
Half-precision inputs are computed in float32 there, as the reference does: a bias of
``-slope * 2000`` in bf16 is off by units, which moves weights near the diagonal by percents.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lssar.ops.common import (
    alibi_bias,
    causal_mask,
    combined_mask,
    compute_dtype,
    length_scale,
    separate_rows,
    unit,
    visible_counts,
)
from lssar.ops.spans import KeySpans, add_at_keys, block_visibility, span_counts

# Elements of one query block's float bias (B|1, H, rows, T_k): 2**23 fp32 values = 32 MiB, e.g.
# 256 rows of 8 heads over 4K keys, 64 rows at 16K keys.
ALIBI_BLOCK_ELEMENTS = 1 << 23


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
    alibi_slopes: Tensor | None = None,
    spans: KeySpans | None = None,
) -> Tensor:
    """Softmax-family attention on SDPA; same contract as the reference. ``(B, H_q, T_q, D_v)``.

    ``alibi_slopes`` (``(H,)`` or ``(B, H)``): ALiBi's bias on the scaled scores; ``spans``
    (documents, a window): each block of query rows over only the keys it may see. Both run by
    query blocks (see the module docstring)."""
    t_q, t_k, d = query.shape[-2], key.shape[-2], query.shape[-1]
    dtype = query.dtype
    # torch's CPU flash kernel reads overlapping rows wrong (an unfold view of the queries gave
    # errors of 1e38 in torch 2.13): such views go in as copies
    query, key, value = separate_rows(query), separate_rows(key), separate_rows(value)
    if variant.qk_norm:  # normalised (and scaled below) in float32, then back to the input dtype
        query, key = unit(query), unit(key).to(dtype)
    # causal with T_q = T_k stays SDPA's is_causal (fused, O(T) memory), also with a row scale
    fused_causal = attn_mask is None and (not is_causal or t_q == t_k)
    # the blocks (ALiBi, spans) build their own masks
    skip = fused_causal or alibi_slopes is not None or spans is not None
    mask = None if skip else combined_mask(attn_mask, is_causal, t_q, t_k, query.device)
    if variant.scaling == "const":  # one scale for every row, per head if learned
        c = torch.tensor(variant.const_scale(d, options), dtype=compute_dtype(query.dtype))
        c = c.to(query.device)
        if "s" in options:
            s_h = torch.as_tensor(options["s"], dtype=c.dtype, device=query.device)
            c = c * (s_h.reshape(1, -1, 1, 1) if s_h.dim() == 1 else s_h)
        query = (query.to(c.dtype) * c).to(dtype)
        scale = 1.0
    elif variant.scaling != "sdpa":
        if spans is None:
            n = visible_counts(attn_mask, is_causal, t_q, t_k, query.device)
        else:
            n = span_counts(spans, attn_mask)
        n = n.to(compute_dtype(query.dtype))
        if variant.scaling == "log_n":
            c = length_scale(n, variant.scale_dim(d, options))
        else:  # ssmax
            s_h = torch.as_tensor(options["s"], dtype=n.dtype, device=query.device)
            s_h = s_h.reshape(1, -1, 1, 1) if s_h.dim() == 1 else s_h
            base = 1.0 / math.sqrt(d) if scale is None else scale
            c = s_h * torch.log(n.clamp_min(1.0)) * base
        query = (query.to(c.dtype) * c).to(dtype)
        scale = 1.0
    query = query.to(dtype)
    if alibi_slopes is not None or spans is not None:
        args = (attn_mask, dropout_p, is_causal, scale, enable_gqa, alibi_slopes, spans)
        return _blocked(query, key, value, *args)
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


def _block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slopes: Tensor | None,
    visible: Tensor | None,
    pos: Tensor,
    keys: Tensor,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """One block of query rows ``q (B, H, rows, D)`` at key positions ``pos (rows,)`` over the
    keys ``k, v (B, H_kv, K, D)`` at positions ``keys (K,)``; ``visible`` (None: all) already
    holds the causal rule, the caller's mask and any spans."""
    bias = None if slopes is None else alibi_bias(slopes, pos, keys, q.dtype)  # (B|1,H,rows,K)
    empty = None
    if visible is not None:
        # SDPA gives NaN for rows with no visible key: let them see everything, then zero them
        empty = ~visible.any(-1, keepdim=True)
        if bias is None:
            bias = visible | empty
        else:
            bias = bias.masked_fill(~(visible | empty), float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, bias, dropout_p, False, scale=scale, enable_gqa=enable_gqa
    )
    return out if empty is None else out.masked_fill(empty, 0.0)


def _blocked(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    slopes: Tensor | None,
    spans: KeySpans | None,
) -> Tensor:
    """SDPA by blocks of query rows, each over only the keys it may see: ALiBi's float bias per
    block and/or ``spans`` (documents, a window). ``(B, H_q, T_q, D_v)`` in the input dtype."""
    b, h, t_q, _ = query.shape
    t_k = key.shape[-2]
    dtype = query.dtype
    # ALiBi in float32 for half inputs (see the module docstring); spans alone keep the dtype
    work = compute_dtype(dtype) if slopes is not None else dtype
    q, k, v = query.to(work), key.to(work), value.to(work)
    slopes = None if slopes is None else slopes.to(work)
    mask_b = 1 if attn_mask is None else attn_mask.shape[0]
    slope_b = slopes.shape[0] if slopes is not None and slopes.dim() == 2 else 1
    per_row = max(slope_b, mask_b) * h * max(t_k, 1)
    rows = max(1, min(t_q, ALIBI_BLOCK_ELEMENTS // per_row))
    # several blocks under autograd: recompute each block in the backward instead of keeping
    # every block's bias and weights (together T_q x T_k); one block keeps the plain graph
    recompute = (
        rows < t_q
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v))
        and not torch._C._are_functorch_transforms_active()
    )
    offset = t_k - t_q  # bottom-right: query row i sits at absolute position offset + i
    all_pos = spans.pos if spans is not None else torch.arange(t_q, device=q.device) + offset
    plan = []  # (rows r0:r1, their keys (None: none), visibility, row positions, key positions)
    for r0 in range(0, t_q, rows):
        r1 = min(t_q, r0 + rows)
        if spans is not None:
            keys, visible = block_visibility(spans, attn_mask, r0, r1)
        else:
            k_end = min(t_k, max(0, offset + r1)) if is_causal else t_k  # a causal block's end
            keys = slice(0, k_end) if k_end > 0 else None
            visible = causal_mask(r1 - r0, k_end, q.device, offset + r0) if is_causal else None
            if attn_mask is not None and keys is not None:
                m = attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., r0:r1, :]
                m = m if m.shape[-1] == 1 else m[..., :k_end]
                visible = m if visible is None else (m & visible)
        key_pos = None
        if keys is not None:
            key_pos = (
                keys
                if not isinstance(keys, slice)
                else torch.arange(keys.start, keys.stop, device=q.device)
            )
        plan.append((r0, r1, keys, visible, all_pos[r0:r1], key_pos))
    kw = dict(dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
    if recompute and dropout_p == 0:
        return _Blocks.apply(q, k, v, slopes, plan, kw).to(dtype)
    outs = []
    for r0, r1, keys, visible, pos, key_pos in plan:
        if keys is None:
            outs.append(q.new_zeros(b, h, r1 - r0, value.shape[-1]))
            continue
        args = (q[:, :, r0:r1], k[:, :, keys], v[:, :, keys], slopes, visible, pos, key_pos)
        if recompute:  # dropout: checkpoint replays each block's random mask
            outs.append(checkpoint(_block, *args, use_reentrant=False, **kw))
        else:
            outs.append(_block(*args, **kw))
    return torch.cat(outs, dim=2).to(dtype)


class _Blocks(torch.autograd.Function):
    """The blocks under autograd, memory and traffic O(T * block): the forward keeps nothing but
    the inputs and the plan; the backward recomputes each block's graph on its own rows and keys
    and adds its gradients into ``dq, dk, dv`` in place. (Slicing under autograd would hand every
    block a zero-filled gradient as large as the whole input: O(T^2 / block) traffic.)"""

    @staticmethod
    def forward(ctx, q, k, v, slopes, plan, kw):
        ctx.save_for_backward(q, k, v, slopes)
        ctx.plan, ctx.kw = plan, kw
        out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
        for r0, r1, keys, visible, pos, key_pos in plan:
            if keys is not None:
                args = (k[:, :, keys], v[:, :, keys], slopes, visible, pos, key_pos)
                out[:, :, r0:r1] = _block(q[:, :, r0:r1], *args, **kw)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, slopes = ctx.saved_tensors
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        for r0, r1, keys, visible, pos, key_pos in ctx.plan:
            if keys is None:
                continue
            with torch.enable_grad():
                qb, kb, vb = (
                    t.detach().requires_grad_()
                    for t in (q[:, :, r0:r1], k[:, :, keys], v[:, :, keys])
                )
                out = _block(qb, kb, vb, slopes, visible, pos, key_pos, **ctx.kw)
                gq, gk, gv = torch.autograd.grad(out, (qb, kb, vb), grad[:, :, r0:r1])
            dq[:, :, r0:r1] += gq
            add_at_keys(dk, keys, gk)
            add_at_keys(dv, keys, gv)
        return dq, dk, dv, None, None, None
