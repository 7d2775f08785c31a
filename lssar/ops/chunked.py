"""Memory-efficient exact LSSA / LSSAR (and any softplus-l1 variant) for CPU and GPU.

Queries are processed in blocks of ``block`` rows. A block's full score rows
``(B, H, block, T_k)`` are formed once, so the two passes of METHOD.md section 4 (row statistics
``Z_i, mu_i, max_j x_ij``, then the weights) happen in-register over that slab; nothing of size
``T_q x T_k`` ever exists. The backward recomputes each block's weights and applies the closed-form
gradients of METHOD.md section 5 (``dx``, the ``F_i`` row term, ``sigmoid`` for Softplus), so the
memory of forward + backward is ``O(T * block)``. Causal blocks stop at their last visible key.

The op is registered as ``lssar::softplus_attention`` (``torch.library.custom_op`` with a fake
implementation and a registered autograd formula), so ``torch.compile`` traces through it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lssar.ops.common import causal_mask, uniform_tolerance

DEFAULT_BLOCK_ELEMS = 1 << 21  # score elements per block: ~8 MB fp32 slabs, a few live at once


def _block_rows(bh: int, t_k: int, block: int) -> int:
    if block > 0:
        return block
    return max(16, min(1024, DEFAULT_BLOCK_ELEMS // max(1, bh * t_k)))


def _ipow(r: Tensor, p: float) -> Tensor:
    """``r**p`` by repeated squaring when ``p`` is a small integer (exact and faster than pow)."""
    if p == int(p) and 1 <= p <= 64:
        n, result, base = int(p), None, r
        while n:
            if n & 1:
                result = base if result is None else result * base
            n >>= 1
            if n:
                base = base * base
        return result
    return r.pow(p)


def _block_mask(
    mask: Tensor | None,
    is_causal: bool,
    i0: int,
    i1: int,
    k_end: int,
    offset: int,
    device: torch.device,
) -> Tensor | None:
    """Visibility of rows ``i0:i1`` over keys ``0:k_end`` (broadcastable to the score slab)."""
    m = None
    if is_causal and offset + i0 < k_end - 1:  # some key in range is in the future of some row
        m = causal_mask(i1 - i0, k_end, device, q_start=offset + i0)
    if mask is not None:
        mb = mask[..., i0:i1, :k_end]
        m = mb if m is None else (mb & m)
    return m


def _counts(
    m: Tensor | None,
    is_causal: bool,
    i0: int,
    i1: int,
    k_end: int,
    offset: int,
    device: torch.device,
) -> Tensor:
    """``N_i`` for the block rows, float32, broadcastable to ``(B, H, rows, 1)``."""
    if m is None and not is_causal:
        return torch.full((1, 1, 1, 1), float(k_end), device=device)
    if m is None or (is_causal and m.dim() == 2):
        n = torch.arange(i0, i1, device=device, dtype=torch.float32) + offset + 1
        return n.clamp(0, k_end).reshape(1, 1, -1, 1)
    return m.sum(-1, keepdim=True, dtype=torch.float32)


def _weights(q: Tensor, k: Tensor, m: Tensor | None, n: Tensor, c: Tensor, p: float | None):
    """Block weights and the intermediates the backward needs. Shapes ``(B, H, rows, T_k)``."""
    s = (q @ k.transpose(-1, -2)) * c  # (B, H, rows, T_k)
    a = F.softplus(s)
    if m is not None:
        a = a * m
    z = a.sum(-1, keepdim=True)
    z_safe = torch.where(z > 0, z, torch.ones_like(z))
    if p is None:
        return s, a / z_safe, z_safe, None
    big = n > 3  # O_i = 1
    mu = torch.where(big, z / n.clamp_min(1.0), torch.zeros_like(z))
    x = F.relu(a - mu)  # masked entries: 0 - mu <= 0
    x_max = x.amax(-1, keepdim=True)
    has = x_max > uniform_tolerance(x.dtype) * mu  # else every weight is uniform up to rounding
    x_max = torch.where(has, x_max, torch.ones_like(x_max))
    r = x / x_max
    w = _ipow(r, p)
    w_sum = w.sum(-1, keepdim=True)
    w_sum = torch.where(has, w_sum, torch.ones_like(w_sum))
    weights = torch.where(has, w / w_sum, a / z_safe)
    return s, weights, z_safe, (big, n, has, x_max, r, w_sum)


def _row_scale(n: Tensor, scale: float, log_n: bool) -> Tensor:
    if log_n:  # c_i = ln(d) ln(N_i), ln(d) passed in as ``scale``
        return scale * torch.log(n.clamp_min(1.0))
    return torch.full_like(n, scale)


def _blocks(t_q: int, t_k: int, rows: int, is_causal: bool):
    offset = t_k - t_q
    for i0 in range(0, t_q, rows):
        i1 = min(t_q, i0 + rows)
        k_end = min(t_k, max(0, offset + i1)) if is_causal else t_k
        yield i0, i1, k_end, offset


def _prep_mask(mask: Tensor | None) -> Tensor | None:
    if mask is None:
        return None
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


@torch.library.custom_op("lssar::softplus_attention", mutates_args=())
def softplus_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    p: float | None,
    block: int,
) -> Tensor:
    """Forward of softplus-l1 attention (+ optional re-weighting). ``q (B,H,T_q,D)``,
    ``k (B,H,T_k,D)``, ``v (B,H,T_k,D_v)`` -> ``(B,H,T_q,D_v)`` in ``q``'s dtype."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    B, H, t_q, _ = q.shape
    t_k = k.shape[2]
    mask = _prep_mask(mask)
    out = torch.zeros(B, H, t_q, v.shape[-1], dtype=dtype, device=q.device)
    rows = _block_rows(B * H, t_k, block)
    for i0, i1, k_end, offset in _blocks(t_q, t_k, rows, is_causal):
        if k_end == 0:
            continue
        m = _block_mask(mask, is_causal, i0, i1, k_end, offset, q.device)
        n = _counts(m, is_causal, i0, i1, k_end, offset, q.device).to(dtype)
        c = _row_scale(n, scale, log_n)
        _, wts, _, _ = _weights(qf[:, :, i0:i1], kf[:, :, :k_end], m, n, c, p)
        out[:, :, i0:i1] = wts @ vf[:, :, :k_end]
    return out.to(q.dtype)


@softplus_attention_op.register_fake
def _(q, k, v, mask, is_causal, scale, log_n, p, block):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("lssar::softplus_attention_backward", mutates_args=())
def softplus_attention_backward_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    p: float | None,
    block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recomputing backward: ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    g = grad.to(dtype)
    B, H, t_q, _ = q.shape
    t_k = k.shape[2]
    mask = _prep_mask(mask)
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    rows = _block_rows(B * H, t_k, block)
    for i0, i1, k_end, offset in _blocks(t_q, t_k, rows, is_causal):
        if k_end == 0:
            continue
        m = _block_mask(mask, is_causal, i0, i1, k_end, offset, q.device)
        n = _counts(m, is_causal, i0, i1, k_end, offset, q.device).to(dtype)
        c = _row_scale(n, scale, log_n)
        qb, kb, vb, gb = qf[:, :, i0:i1], kf[:, :, :k_end], vf[:, :, :k_end], g[:, :, i0:i1]
        s, wts, z, stats = _weights(qb, kb, m, n, c, p)
        dp = gb @ vb.transpose(-1, -2)  # (B, H, rows, T_k)
        # D_i = sum_j P_ij dP_ij from the same slab (not g_i.out_i): exact cancellation for
        # one-key rows, where dP - D would otherwise be pure rounding amplified by p / x_max
        centred = dp - (wts * dp).sum(-1, keepdim=True)
        da_l1 = centred / z
        if stats is None:
            da = da_l1
        else:
            big, n, has, x_max, r, w_sum = stats
            # dx = p P (dP - D) / x, with P / x = r^(p-1) / (sum_w * x_max) (no division by x)
            if p > 1:
                r_pm1 = _ipow(r, p - 1)
            else:  # r^(p-1) is 1 (p = 1) or unbounded (p < 1) at r = 0, where dx must be 0
                r_pm1 = torch.where(r > 0, r.pow(p - 1), torch.zeros_like(r))
            dx = (p / (w_sum * x_max)) * r_pm1 * centred
            f = dx.sum(-1, keepdim=True)
            da = dx - torch.where(big, f / n.clamp_min(1.0), torch.zeros_like(f))
            da = torch.where(has, da, da_l1)
        ds = da * torch.sigmoid(s) * c
        if m is not None:
            ds = ds * m
        dv[:, :, :k_end] += wts.transpose(-1, -2) @ gb
        dq[:, :, i0:i1] = ds @ kb
        dk[:, :, :k_end] += ds.transpose(-1, -2) @ qb
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@softplus_attention_backward_op.register_fake
def _(grad, q, k, v, mask, is_causal, scale, log_n, p, block):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, log_n, p, block = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.args = (is_causal, scale, log_n, p, block)


def _backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = softplus_attention_backward_op(grad.contiguous(), q, k, v, mask, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


softplus_attention_op.register_autograd(_backward, setup_context=_setup_context)


def chunked_attention(
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
    block: int = 0,
) -> Tensor:
    """Memory-efficient softplus-l1 attention (lssa, lssar, softplus-l1 with any ``p``).

    Same contract as :func:`lssar.ops.reference.reference_attention`; ``block`` = query rows per
    block (0 = choose from the sequence length). Returns ``(B, H_q, T_q, D_v)``.
    """
    from lssar.ops.common import expand_kv

    if dropout_p > 0:
        raise ValueError("impl='chunked' has no dropout; use impl='reference' for dropout_p > 0")
    if enable_gqa:
        key, value = expand_kv(query, key, value)
    d = query.shape[-1]
    if variant.qk_norm:
        query, key = F.normalize(query, dim=-1), F.normalize(key, dim=-1)
    if variant.scaling == "log_n":
        c, log_n = math.log(d), True
    else:
        c, log_n = (1.0 / math.sqrt(d) if scale is None else float(scale)), False
    p = options.get("p")
    return softplus_attention_op(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        float(c),
        log_n,
        None if p is None else float(p),
        int(block),
    )
