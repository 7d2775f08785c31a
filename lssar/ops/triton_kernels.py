"""Fused Triton kernels (FlashAttention-2 style) for the softplus-l1 family (lssa, lssar, ...).

The math is METHOD.md sections 3-5 and mirrors :mod:`lssar.ops.chunked` exactly (mean-centred
``x = softplus(s) - mu_i``, ``mu_i = Z_i / N_i`` for ``N_i > 3``, ``r = x / x_max``, LSSA weights
for rows whose ``x`` are all within ``uniform_tolerance * mu_i``, zeros for rows with
``N_i = 0``). Only the schedule differs:

forward (grid: query blocks x batch*heads; the ``T_q x T_k`` scores never exist)
    LSSA: one pass over the key blocks accumulating ``sum_j softplus(s_ij) v_j`` and ``Z_i``
    (Softplus needs no running max, so there is no rescaling as in softmax).
    LSSAR: pass 1 gives ``Z_i`` and ``m_i = max_j s_ij``; Softplus is monotone, so
    ``x_max = softplus(m_i) - mu_i`` (un-centred ``softplus(m_i)`` when ``N_i <= 3``);
    pass 2 accumulates ``r^p v`` and ``W_i = sum_j r^p`` with ``r in [0, 1]`` (no overflow).
    Per-row statistics ``(N, mu, x_max, W)`` (fp32, ``x_max = 0`` marks the LSSA fallback) are
    kept for the backward.
backward (deterministic, no atomics)
    rows kernel: ``D_i = sum_j P_ij dP_ij`` and ``F_i = sum_j dx_ij`` in one pass over the keys
    (LSSA: ``D_i = g_i . out_i`` and no pass); dq kernel over key blocks per query block; dk/dv
    kernel over query blocks (and the ``H_q / H_kv`` query heads of a GQA group) per key block.

Inputs ``q, k`` of the length-scaled variants are L2-normalised *inside* the kernels: the raw
``q . k`` dot (fp32 accumulation) is scaled by fp32 inverse norms, which is as accurate as
normalising in fp32 and keeps the kernels' inputs in the model's dtype. The op's gradients are
taken through the normalisation in fp32 (``dq = dq_fix - q_hat (q_hat . dq_fix)``).

Conventions (shared with every implementation, see :mod:`lssar.ops.common`): layout
``[B, H, T, D]``; GQA with head ``h`` reading kv head ``h // (H_q / H_kv)``; bottom-right causal
alignment (query ``t`` sits at absolute position ``T_k - T_q + t``); boolean ``attn_mask``
broadcastable to ``[B, H_q, T_q, T_k]``, combinable with ``is_causal``; ``N_i`` = visible keys,
computed in torch before the launch (a ``[B, H_q, T_q]`` vector). Head dims up to 256 (any
value: tiles are padded to a power of two); ``D_v`` may differ from ``D``.

Precision: statistics and accumulators are fp32 for every input dtype; fp32 inputs use IEEE fp32
dots (no TF32). For half inputs the fp32 weights / score gradients must enter the tensor cores in
the input dtype: by default (``precise=True``) each goes in as a ``hi + lo`` pair (two MMAs,
error ~2^-16 instead of 2^-9 for bf16), which keeps outputs and gradients as accurate as the
fp32-computed reference; ``precise=False`` rounds once, as FlashAttention does (1 MMA, ~2x the
reference's error). Softplus is ``max(s, 0) + log1p(exp(-|s|))`` with a two-MUFU log1p.

Limits: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (slow; for tests). ``float64``
inputs are handed to :func:`lssar.ops.chunked.chunked_attention` (same math, exact in float64).
No dropout. Block sizes are autotuned per (head dim, flags, length bucket) on the GPU; under the
interpreter a fixed 16 x 16 tile is used. ``TRITON_INTERPRET=1`` must be set before ``triton`` is
first imported (``triton.jit``, here and in ``triton.language``'s own helpers such as ``tl.zeros``,
picks compiled or interpreted code when a function is decorated). Two Triton 3.9 interpreter
defects are worked around only when interpreting: bf16 ``tl.dot`` (wrong: operands are upcast)
and fp32 -> bf16 stores (truncated: torch rounds the output instead).
"""

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from lssar.ops.common import causal_mask, check_inputs, count_visible, uniform_tolerance
from lssar.ops.registry import register_impl
from lssar.ops.variants import Variant

MAX_HEAD_DIM = 256
NORM_EPS = 1e-12  # F.normalize's eps: x / max(||x||, eps)
INTERPRET_BLOCK = 16  # tl.dot needs tiles of at least 16
UNIFORM_TOL = uniform_tolerance(torch.float32)  # statistics are fp32 for every input dtype


def _interpreting() -> bool:
    """Whether the kernels were decorated for the interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETED


# ----------------------------------------------------------------------------- device functions


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # IEEE: fp32 inputs must not be rounded to tf32 (the reference is exact fp32).
    # UPCAST: the Triton 3.9 interpreter computes bf16 dots on the raw bits; fp32 is exact there.
    if UPCAST:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        res = tl.dot(a, b, input_precision="ieee")
    else:
        res = tl.dot(a, b)
    return res


@triton.jit
def _dot_lp(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr):
    # fp32 a (weights, dscores) times b in the input dtype. a is rounded to b's dtype for the
    # tensor cores; SPLIT adds the rounding residual as a second product (a = hi + lo, error
    # ~2^-16 instead of 2^-9 for bf16), which keeps half-precision outputs as accurate as the
    # fp32-computed reference's at the cost of one extra MMA per product.
    hi = a.to(b.dtype)
    res = _dot(hi, b, IEEE, UPCAST)
    if SPLIT:
        res += _dot((a - hi.to(tl.float32)).to(b.dtype), b, IEEE, UPCAST)
    return res


@triton.jit
def _softplus_parts(s):
    # softplus(s) = max(s, 0) + log1p(u), u = exp(-|s|) in (0, 1]. With w = fl(1 + u), the
    # rounding residual d = u - (w - 1) is exact (Sterbenz) and log1p(u) = log(w) + d / w to
    # second order; d is below 2^-24, so 1/w on [1, 2] needs only the chord 1.5 - 0.5 w. Result:
    # a few-ulp log1p (tiny u included: w = 1 gives u) for two MUFU ops (exp, log), no divide.
    u = tl.exp(-tl.abs(s))
    w = 1.0 + u
    lp = tl.log(w) + (u - (w - 1.0)) * (1.5 - 0.5 * w)
    return tl.maximum(s, 0.0) + lp, u, w


@triton.jit
def _softplus(s):
    sp, _, _ = _softplus_parts(s)
    return sp


@triton.jit
def _softplus_sigmoid(s):
    sp, u, w = _softplus_parts(s)
    return sp, tl.where(s >= 0, 1.0 / w, u / w)  # sigmoid from the same exp(-|s|)


@triton.jit
def _ipow(r, E: tl.constexpr):
    # r**E by square-and-multiply, unrolled at compile time (E <= 127).
    res = tl.full(r.shape, 1.0, tl.float32)
    base = r
    for i in tl.static_range(7):
        if (E >> i) & 1:
            res = res * base
        if (E >> (i + 1)) > 0:
            base = base * base
    return res


@triton.jit
def _sharpen(a, mu, inv_xmax, p, P_INT: tl.constexpr):
    # (r^p, r^(p-1)) for r = relu(a - mu) / x_max; r^(p-1) := 0 where r = 0 (dx = 0 there, and
    # r^(p-1) is 1 or unbounded at r = 0 for p <= 1). P_INT > 0: integer p, exact products.
    r = tl.maximum(a - mu[:, None], 0.0) * inv_xmax[:, None]
    pos = r > 0
    if P_INT > 0:
        rpm1 = _ipow(r, P_INT - 1)
    else:
        rpm1 = tl.exp2((p - 1.0) * tl.log2(tl.where(pos, r, 1.0)))
    rpm1 = tl.where(pos, rpm1, 0.0)
    return rpm1 * r, rpm1


@triton.jit
def _scores(
    q,
    k,
    cq,
    ik,
    offs_m,
    offs_n,
    Mb,
    smq,
    smk,
    Tq,
    Tk,
    off,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    QK_NORM: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # s_ij = c_i * (q_i . k_j) / (|q_i| |k_j|), fp32 (BM, BN), and its visibility.
    s = _dot(q, tl.trans(k), IEEE, UPCAST) * cq[:, None]
    if QK_NORM:
        s = s * ik[None, :]
    vis = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= offs_m[:, None] + off)
    if HAS_MASK:
        allowed = tl.load(Mb + offs_m[:, None] * smq + offs_n[None, :] * smk, mask=vis, other=0)
        vis = vis & (allowed != 0)
    return s, vis


@triton.jit
def _row_scale(n, c0, IQr, rows, rmask, LOG_N: tl.constexpr, QK_NORM: tl.constexpr):
    # c_i (times 1/|q_i| when q is normalised in-kernel): ln(d) ln(N_i), or the constant scale.
    if LOG_N:
        c = c0 * tl.log(tl.maximum(n, 1.0))
    else:
        c = tl.zeros(n.shape, tl.float32) + c0
    if QK_NORM:
        c = c * tl.load(IQr + rows, mask=rmask, other=0.0)
    return c


@triton.jit
def _probs_dscores(
    a, sig, dp, vis, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT: tl.constexpr, REWEIGHT
):
    # P_ij and dL/ds_ij (METHOD.md section 5); LSSA / fallback rows: da = (dP - D) / W.
    cen = dp - d[:, None]
    if REWEIGHT:
        w, rpm1 = _sharpen(a, mu, inv_xmax, p, P_INT)
        da = tl.where(has[:, None], coef[:, None] * rpm1 * cen - fn[:, None], cen * winv[:, None])
        w = tl.where(has[:, None], w, a)
    else:
        da = cen * winv[:, None]
        w = a
    prob = tl.where(vis, w * winv[:, None], 0.0)
    ds = tl.where(vis, da * sig, 0.0)
    return prob, ds


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _fwd_kernel(
    Q, K, V, O, ST, IQ, IK, M,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
        mask=rmask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    n = tl.load(ST + rows, mask=rmask, other=0.0)
    cq = _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    IKb = IK + (b * (H // G) + hk) * Tk
    Mb = M + b * smb + h * smh
    hi = Tk
    if CAUSAL:  # the block's last row sees keys up to off + (pid_m + 1) * BM - 1
        hi = tl.minimum(Tk, off + (pid_m + 1) * BM)

    mu = tl.zeros((BM,), tl.float32)
    xmax = tl.zeros((BM,), tl.float32)
    if REWEIGHT:
        z = tl.zeros((BM,), tl.float32)
        mx = tl.full((BM,), float("-inf"), tl.float32)
        for start_n in range(0, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            kmask = offs_n < Tk
            k = tl.load(
                Kb + offs_n[:, None] * skt + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
            s, vis = _scores(
                q, k, cq, ik, offs_m, offs_n, Mb, smq, smk, Tq, Tk, off,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST,
            )  # fmt: skip
            z += tl.sum(tl.where(vis, _softplus(s), 0.0), 1)
            mx = tl.maximum(mx, tl.max(tl.where(vis, s, float("-inf")), 1))
        mu = tl.where(n > 3.0, z / tl.maximum(n, 1.0), 0.0)
        # softplus is monotone: the row's largest x is softplus(max s) - mu (0 for empty rows);
        # deviations within tol * mu of the mean are rounding noise: a uniform row, LSSA weights
        xmax = tl.maximum(_softplus(mx) - mu, 0.0)
        xmax = tl.where(xmax > tol * mu, xmax, 0.0)
    has = xmax > 0
    inv_xmax = 1.0 / tl.where(has, xmax, 1.0)

    acc = tl.zeros((BM, BDV), tl.float32)
    wsum = tl.zeros((BM,), tl.float32)
    for start_n in range(0, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        kmask = offs_n < Tk
        k = tl.load(
            Kb + offs_n[:, None] * skt + offs_d[None, :],
            mask=kmask[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
        s, vis = _scores(
            q, k, cq, ik, offs_m, offs_n, Mb, smq, smk, Tq, Tk, off,
            CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST,
        )  # fmt: skip
        a = _softplus(s)
        if REWEIGHT:
            w, _ = _sharpen(a, mu, inv_xmax, p, P_INT)
            w = tl.where(has[:, None], w, a)
        else:
            w = a
        w = tl.where(vis, w, 0.0)
        wsum += tl.sum(w, 1)
        v = tl.load(
            Vb + offs_n[:, None] * svt + offs_dv[None, :],
            mask=kmask[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        acc += _dot_lp(w, v, IEEE, UPCAST, SPLIT)
    out = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
    tl.store(
        O + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=rmask[:, None] & (offs_dv[None, :] < DV),
    )
    tl.store(ST + plane + rows, mu, mask=rmask)
    tl.store(ST + 2 * plane + rows, xmax, mask=rmask)
    tl.store(ST + 3 * plane + rows, wsum, mask=rmask)


@triton.jit
def _bwd_rows_kernel(
    Q, K, V, O, GO, ST, DF, IQ, IK, M,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sgb, sgh, sgt,
    smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # D_i = sum_j P_ij dP_ij and F_i = sum_j dx_ij. For LSSAR both come from one pass over the
    # keys with the same fp32 P as the dq/dk/dv kernels (not from the rounded output):
    # F_i = p / (W x_max) * (sum_j r^(p-1) dP_ij - D_i sum_j r^(p-1)).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    gmask = rmask[:, None] & (offs_dv[None, :] < DV)
    go = tl.load(
        GO + b * sgb + h * sgh + offs_m[:, None] * sgt + offs_dv[None, :], mask=gmask, other=0.0
    )
    f = tl.zeros((BM,), tl.float32)
    if REWEIGHT:
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
            mask=rmask[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        n = tl.load(ST + rows, mask=rmask, other=0.0)
        mu = tl.load(ST + plane + rows, mask=rmask, other=0.0)
        xmax = tl.load(ST + 2 * plane + rows, mask=rmask, other=0.0)
        wtot = tl.load(ST + 3 * plane + rows, mask=rmask, other=0.0)
        cq = _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM)
        has = xmax > 0
        inv_xmax = 1.0 / tl.where(has, xmax, 1.0)
        winv = 1.0 / tl.where(wtot > 0, wtot, 1.0)
        Kb = K + b * skb + hk * skh
        Vb = V + b * svb + hk * svh
        IKb = IK + (b * (H // G) + hk) * Tk
        Mb = M + b * smb + h * smh
        hi = Tk
        if CAUSAL:
            hi = tl.minimum(Tk, off + (pid_m + 1) * BM)
        dsum = tl.zeros((BM,), tl.float32)
        s1 = tl.zeros((BM,), tl.float32)
        s2 = tl.zeros((BM,), tl.float32)
        for start_n in range(0, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            kmask = offs_n < Tk
            k = tl.load(
                Kb + offs_n[:, None] * skt + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
            v = tl.load(
                Vb + offs_n[:, None] * svt + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )
            s, vis = _scores(
                q, k, cq, ik, offs_m, offs_n, Mb, smq, smk, Tq, Tk, off,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST,
            )  # fmt: skip
            a = _softplus(s)
            w, rpm1 = _sharpen(a, mu, inv_xmax, p, P_INT)
            w = tl.where(vis, tl.where(has[:, None], w, a), 0.0)
            rpm1 = tl.where(vis, rpm1, 0.0)
            dp = _dot(go, tl.trans(v), IEEE, UPCAST)
            dsum += tl.sum(w * dp, 1)
            s1 += tl.sum(rpm1 * dp, 1)
            s2 += tl.sum(rpm1, 1)
        d = dsum * winv
        f = tl.where(has, p * winv * inv_xmax * (s1 - d * s2), 0.0)
    else:
        o = tl.load(
            O + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :], mask=gmask, other=0.0
        )
        d = tl.sum(go.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DF + rows, d, mask=rmask)
    tl.store(DF + plane + rows, f, mask=rmask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, GO, ST, DF, IQ, IK, M, DQ,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # dq_fix_i = sum_j ds_ij c_i / (|q_i| |k_j|) k_j (gradient at fixed norms), fp32 (B,H,Tq,BD).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
        mask=rmask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    go = tl.load(
        GO + b * sgb + h * sgh + offs_m[:, None] * sgt + offs_dv[None, :],
        mask=rmask[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    n = tl.load(ST + rows, mask=rmask, other=0.0)
    mu = tl.load(ST + plane + rows, mask=rmask, other=0.0)
    xmax = tl.load(ST + 2 * plane + rows, mask=rmask, other=0.0)
    wtot = tl.load(ST + 3 * plane + rows, mask=rmask, other=0.0)
    d = tl.load(DF + rows, mask=rmask, other=0.0)
    f = tl.load(DF + plane + rows, mask=rmask, other=0.0)
    cq = _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM)
    has = xmax > 0
    inv_xmax = 1.0 / tl.where(has, xmax, 1.0)
    winv = 1.0 / tl.where(wtot > 0, wtot, 1.0)
    coef = p * winv * inv_xmax
    fn = tl.where(n > 3.0, f / tl.maximum(n, 1.0), 0.0)  # the mean-centring term F_i / N_i
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    IKb = IK + (b * (H // G) + hk) * Tk
    Mb = M + b * smb + h * smh
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(Tk, off + (pid_m + 1) * BM)
    dq = tl.zeros((BM, BD), tl.float32)
    for start_n in range(0, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        kmask = offs_n < Tk
        k = tl.load(
            Kb + offs_n[:, None] * skt + offs_d[None, :],
            mask=kmask[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
        v = tl.load(
            Vb + offs_n[:, None] * svt + offs_dv[None, :],
            mask=kmask[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        s, vis = _scores(
            q, k, cq, ik, offs_m, offs_n, Mb, smq, smk, Tq, Tk, off,
            CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST,
        )  # fmt: skip
        a, sig = _softplus_sigmoid(s)
        dp = _dot(go, tl.trans(v), IEEE, UPCAST)
        _, ds = _probs_dscores(
            a, sig, dp, vis, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT, REWEIGHT
        )
        ds = ds * cq[:, None]
        if QK_NORM:
            ds = ds * ik[None, :]
        dq += _dot_lp(ds, k, IEEE, UPCAST, SPLIT)
    tl.store(
        DQ + rows[:, None] * BD + offs_d[None, :], dq, mask=rmask[:, None] & (offs_d[None, :] < D)
    )


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, GO, ST, DF, IQ, IK, M, DK, DVO,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # One key block of one kv head; loops over the G query heads of its GQA group and over the
    # query blocks that can see it, so dk/dv are summed in registers (deterministic).
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1).to(tl.int64)
    HK = H // G
    b = pid_bk // HK
    hk = pid_bk % HK
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    kmask = offs_n < Tk
    k = tl.load(
        K + b * skb + hk * skh + offs_n[:, None] * skt + offs_d[None, :],
        mask=kmask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    v = tl.load(
        V + b * svb + hk * svh + offs_n[:, None] * svt + offs_dv[None, :],
        mask=kmask[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    ik = tl.load(IK + pid_bk * Tk + offs_n, mask=kmask, other=0.0)
    lo = 0
    if CAUSAL:  # query i sees key j iff j <= off + i: rows before n0 - off cannot see this block
        lo = (tl.maximum(pid_n * BN - off, 0) // BM) * BM
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BDV), tl.float32)
    for g in range(G):
        h = hk * G + g
        bh = b * H + h
        Qb = Q + b * sqb + h * sqh
        GOb = GO + b * sgb + h * sgh
        Mb = M + b * smb + h * smh
        for start_m in range(lo, Tq, BM):
            offs_m = start_m + tl.arange(0, BM)
            rmask = offs_m < Tq
            rows = bh * Tq + offs_m
            q = tl.load(
                Qb + offs_m[:, None] * sqt + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            go = tl.load(
                GOb + offs_m[:, None] * sgt + offs_dv[None, :],
                mask=rmask[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )
            n = tl.load(ST + rows, mask=rmask, other=0.0)
            mu = tl.load(ST + plane + rows, mask=rmask, other=0.0)
            xmax = tl.load(ST + 2 * plane + rows, mask=rmask, other=0.0)
            wtot = tl.load(ST + 3 * plane + rows, mask=rmask, other=0.0)
            d = tl.load(DF + rows, mask=rmask, other=0.0)
            f = tl.load(DF + plane + rows, mask=rmask, other=0.0)
            cq = _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM)
            has = xmax > 0
            inv_xmax = 1.0 / tl.where(has, xmax, 1.0)
            winv = 1.0 / tl.where(wtot > 0, wtot, 1.0)
            coef = p * winv * inv_xmax
            fn = tl.where(n > 3.0, f / tl.maximum(n, 1.0), 0.0)
            s, vis = _scores(
                q, k, cq, ik, offs_m, offs_n, Mb, smq, smk, Tq, Tk, off,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST,
            )  # fmt: skip
            a, sig = _softplus_sigmoid(s)
            dp = _dot(go, tl.trans(v), IEEE, UPCAST)
            prob, ds = _probs_dscores(
                a, sig, dp, vis, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT, REWEIGHT
            )
            ds = ds * cq[:, None]
            if QK_NORM:
                ds = ds * ik[None, :]
            dv += _dot_lp(tl.trans(prob), go, IEEE, UPCAST, SPLIT)
            dk += _dot_lp(tl.trans(ds), q, IEEE, UPCAST, SPLIT)
    kv_rows = pid_bk * Tk + offs_n
    tl.store(
        DK + kv_rows[:, None] * BD + offs_d[None, :],
        dk,
        mask=kmask[:, None] & (offs_d[None, :] < D),
    )
    tl.store(
        DVO + kv_rows[:, None] * BDV + offs_dv[None, :],
        dv,
        mask=kmask[:, None] & (offs_dv[None, :] < DV),
    )


# set when triton.jit returned interpreter functions (a module constant: torch.compile reads it)
_INTERPRETED = not isinstance(_fwd_kernel, triton.runtime.JITFunction)

# ----------------------------------------------------------------------------- autotuning

_TUNE_KEY = ["tq_key", "tk_key", "BD", "BDV", "CAUSAL", "HAS_MASK", "REWEIGHT", "P_INT", "SPLIT"]


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BM": m, "BN": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _prune_rows(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list:
    """Drop row tiles far taller than the query block (decoding, T_q = 1) to save tuning time."""
    tq = named_args.get("tq_key", kwargs.get("tq_key", 1 << 30))
    kept = [c for c in configs if c.kwargs["BM"] <= max(16, tq)]
    return kept or configs[:1]


# Row-parallel kernels (forward, rows, dq): tall query tiles; key-parallel dk/dv: tall key tiles.
# The lists hold, for D = 64 and 128, configurations that ptxas (sm_90a) compiles without
# register spills, plus a few larger tiles for the autotuner to weigh against them.
_ROW_CONFIGS = _configs(
    [
        (128, 64, 8, 3),
        (128, 64, 8, 2),
        (128, 32, 8, 2),
        (64, 64, 4, 3),
        (64, 32, 4, 2),
        (128, 128, 8, 2),
        (16, 64, 4, 2),
    ]
)
_COL_CONFIGS = _configs(
    [
        (32, 128, 8, 2),
        (32, 64, 8, 2),
        (64, 128, 8, 2),
        (32, 32, 4, 2),
        (64, 32, 4, 2),
        (16, 64, 4, 2),
    ]
)
_PRUNE = {"early_config_prune": _prune_rows}
_fwd_tuned = triton.autotune(_ROW_CONFIGS, key=_TUNE_KEY, prune_configs_by=_PRUNE)(_fwd_kernel)
_rows_tuned = triton.autotune(_ROW_CONFIGS, key=_TUNE_KEY, prune_configs_by=_PRUNE)(
    _bwd_rows_kernel
)
_dq_tuned = triton.autotune(_ROW_CONFIGS, key=_TUNE_KEY, prune_configs_by=_PRUNE)(_bwd_dq_kernel)
_dkdv_tuned = triton.autotune(_COL_CONFIGS, key=_TUNE_KEY)(_bwd_dkdv_kernel)


def _launch(kernel, tuned, rows: int, parallel: int, *args: Any, **kwargs: Any) -> None:
    """Launch ``ceil(rows / block) x parallel`` programs; fixed 16x16 tiles when interpreted."""
    if _interpreting():
        grid = (triton.cdiv(rows, INTERPRET_BLOCK), parallel)
        kernel[grid](*args, BM=INTERPRET_BLOCK, BN=INTERPRET_BLOCK, **kwargs)
        return
    block = "BN" if kernel is _bwd_dkdv_kernel else "BM"
    tuned[lambda meta: (triton.cdiv(rows, meta[block]), parallel)](*args, **kwargs)


# ----------------------------------------------------------------------------- host side


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _len_key(t: int) -> int:
    """Autotuning bucket for a sequence length (re-tuning per decode step would be ruinous)."""
    return min(triton.next_power_of_2(max(t, 1)), 1 << 14)


def _p_int(p: float | None) -> int:
    """``p`` as a compile-time integer when it is one in [1, 127], else 0 (exp2/log2 path)."""
    if p is not None and p == int(p) and 1 <= p <= 127:
        return int(p)
    return 0


def _mask4(mask: Tensor | None) -> Tensor | None:
    if mask is None:
        return None
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _visible_counts(
    mask4: Tensor | None, is_causal: bool, b: int, h: int, t_q: int, t_k: int, device
) -> Tensor:
    """``N_i`` as float32 ``(B, H_q, T_q)`` (an expanded view; exact below 2**24)."""
    off = t_k - t_q
    if mask4 is None:
        if is_causal:
            n = (torch.arange(t_q, device=device) + off + 1).clamp(0, t_k)
        else:
            n = torch.full((t_q,), t_k, device=device)
        return n.to(torch.float32).expand(b, h, t_q)
    if not is_causal:
        n = count_visible(mask4, t_k).squeeze(-1)  # (B|1, H|1, T_q|1)
    elif mask4.shape[-2] == 1:  # key padding + causal: prefix sums, no (T_q, T_k) temporary
        cs = mask4[..., 0, :].cumsum(-1, dtype=torch.float32)  # (B|1, H|1, T_k)
        last = torch.arange(t_q, device=device) + off  # last key each row may see
        n = cs.index_select(-1, last.clamp(0, t_k - 1))
        n = torch.where(last >= 0, n, torch.zeros_like(n))
    else:
        n = count_visible(mask4 & causal_mask(t_q, t_k, device, q_start=off), t_k).squeeze(-1)
    return n.expand(b, h, t_q)


def _inv_norm(x: Tensor) -> Tensor:
    """``1 / max(||x||, eps)`` in fp32 over the last dim: ``(B, H, T)``, contiguous."""
    norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    return (1.0 / norm.clamp_min(NORM_EPS)).contiguous()


def _unit_scale(x: Tensor) -> Tensor:
    # by a power of two near the largest entry: exact in every dtype, so no rounding is added
    big = x.detach().abs().amax(-1, keepdim=True).to(torch.float32)
    ok = (big > 0) & torch.isfinite(big)
    pow2 = torch.exp2(torch.floor(torch.log2(torch.where(ok, big, 1.0))))
    return (x.to(torch.float32) / pow2).to(x.dtype)


def _unnormalise_grad(x: Tensor, g_fix: Tensor) -> Tensor:
    """Gradient through ``x_hat = x / max(||x||, eps)`` from the fixed-norm gradient ``g_fix``.

    ``g_fix = dL/dx`` with the norm held constant (what the kernels produce); the norm's own
    dependence removes the radial part: ``dx = g_fix - x_hat (x_hat . g_fix)`` (unless clamped).
    """
    xf = x.to(torch.float32)
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    x_hat = xf / norm.clamp_min(NORM_EPS)
    radial = (x_hat * g_fix).sum(-1, keepdim=True) * (norm > NORM_EPS)
    return torch.where(norm > 0, g_fix - x_hat * radial, 0.0)  # a zero vector: zero gradient


class _Launch:
    """Everything the four kernels share: pointers' strides, sizes, flags."""

    def __init__(self, q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, stats):
        B, H, t_q, d = q.shape
        hk, t_k, dv = k.shape[1], k.shape[2], v.shape[-1]
        self.B, self.H, self.HK, self.t_q, self.t_k = B, H, hk, t_q, t_k
        self.q, self.k, self.v = q, k, v
        self.stats = stats
        self.iq = _inv_norm(q) if qk_norm else stats
        self.ik = _inv_norm(k) if qk_norm else stats
        m4 = _mask4(mask)
        if m4 is None:
            self.m, self.mstrides = stats, (0, 0, 0, 0)
        else:
            # bool -> uint8 view keeps the broadcast (zero) strides: no copy of the mask
            self.m = m4.expand(B, H, t_q, t_k).view(torch.uint8)
            self.mstrides = self.m.stride()
        pp = 1.0 if p is None else p
        self.scalars = (H, H // hk, t_q, t_k, t_k - t_q, B * H * t_q, scale, pp, UNIFORM_TOL)
        self.keys = (_len_key(t_q), _len_key(t_k))
        self.meta = dict(
            D=d,
            DV=dv,
            BD=_pow2(d),
            BDV=_pow2(dv),
            CAUSAL=bool(is_causal),
            HAS_MASK=m4 is not None,
            LOG_N=bool(log_n),
            QK_NORM=bool(qk_norm),
            REWEIGHT=p is not None,
            P_INT=_p_int(p),
            IEEE=q.dtype == torch.float32,
            UPCAST=_interpreting() and q.dtype == torch.bfloat16,
            SPLIT=bool(precise) and q.dtype in (torch.float16, torch.bfloat16),
        )

    def strides(self, *ts: Tensor) -> tuple[int, ...]:
        return tuple(s for t in ts for s in t.stride()[:3])


def _contiguous_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise):
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    B, H, t_q, _ = q.shape
    t_k = k.shape[2]
    # the Triton 3.9 interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): let torch
    # round the interpreter's bf16 outputs
    buf_dtype = torch.float32 if _interpreting() and q.dtype == torch.bfloat16 else q.dtype
    out = torch.zeros(B, H, t_q, v.shape[-1], dtype=buf_dtype, device=q.device)
    stats = torch.zeros(4, B, H, t_q, dtype=torch.float32, device=q.device)  # N, mu, x_max, W
    if t_q == 0 or t_k == 0 or B * H == 0:
        return out, stats
    stats[0] = _visible_counts(_mask4(mask), is_causal, B, H, t_q, t_k, q.device)
    L = _Launch(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, stats)
    _launch(
        _fwd_kernel,
        _fwd_tuned,
        t_q,
        B * H,
        q, k, v, out, stats, L.iq, L.ik, L.m,
        *L.strides(q, k, v, out), *L.mstrides,
        *L.scalars, *L.keys,
        **L.meta,
    )  # fmt: skip
    return out.to(q.dtype), stats


def _backward(grad, q, k, v, out, mask, stats, is_causal, scale, log_n, qk_norm, p, precise):
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    grad, out = _contiguous_last(grad), _contiguous_last(out)
    B, H, t_q, d = q.shape
    hk, t_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    if t_q == 0 or t_k == 0 or B * H == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    L = _Launch(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, stats)
    bd, bdv = L.meta["BD"], L.meta["BDV"]
    dev = q.device
    df = torch.empty(2, B, H, t_q, dtype=torch.float32, device=dev)  # D_i, F_i
    dq = torch.empty(B, H, t_q, bd, dtype=torch.float32, device=dev)
    dk = torch.empty(B, hk, t_k, bd, dtype=torch.float32, device=dev)
    dvv = torch.empty(B, hk, t_k, bdv, dtype=torch.float32, device=dev)
    common = (*L.scalars, *L.keys)
    _launch(
        _bwd_rows_kernel,
        _rows_tuned,
        t_q,
        B * H,
        q, k, v, out, grad, stats, df, L.iq, L.ik, L.m,
        *L.strides(q, k, v, out, grad), *L.mstrides,
        *common,
        **L.meta,
    )  # fmt: skip
    _launch(
        _bwd_dq_kernel,
        _dq_tuned,
        t_q,
        B * H,
        q, k, v, grad, stats, df, L.iq, L.ik, L.m, dq,
        *L.strides(q, k, v, grad), *L.mstrides,
        *common,
        **L.meta,
    )  # fmt: skip
    _launch(
        _bwd_dkdv_kernel,
        _dkdv_tuned,
        t_k,
        B * hk,
        q, k, v, grad, stats, df, L.iq, L.ik, L.m, dk, dvv,
        *L.strides(q, k, v, grad), *L.mstrides,
        *common,
        **L.meta,
    )  # fmt: skip
    dq, dk, dvv = dq[..., :d], dk[..., :d], dvv[..., :dv]
    if qk_norm:
        dq, dk = _unnormalise_grad(q, dq), _unnormalise_grad(k, dk)
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype)


@torch.library.custom_op("lssar::triton_softplus_attention", mutates_args=())
def triton_softplus_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    qk_norm: bool,
    p: float | None,
    precise: bool,
) -> tuple[Tensor, Tensor]:
    """Fused forward. ``q (B,H_q,T_q,D)``, ``k (B,H_kv,T_k,D)``, ``v (B,H_kv,T_k,D_v)`` ->
    ``(out (B,H_q,T_q,D_v)`` in ``q``'s dtype, ``stats (4,B,H_q,T_q)`` fp32: N, mu, x_max, W).

    ``scale`` is ``ln(D)`` when ``log_n`` (then ``c_i = scale * ln N_i``), else the constant ``c``;
    ``qk_norm`` L2-normalises ``q`` and ``k`` in-kernel; ``p`` is the re-weighting power or None;
    ``precise`` splits half-precision weights into two products (see :func:`triton_attention`).
    """
    return _forward(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise)


@triton_softplus_attention_op.register_fake
def _(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise):
    B, H, t_q, _ = q.shape
    return q.new_empty(B, H, t_q, v.shape[-1]), q.new_empty(4, B, H, t_q, dtype=torch.float32)


@torch.library.custom_op("lssar::triton_softplus_attention_backward", mutates_args=())
def triton_softplus_attention_backward_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    mask: Tensor | None,
    stats: Tensor,
    is_causal: bool,
    scale: float,
    log_n: bool,
    qk_norm: bool,
    p: float | None,
    precise: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused backward: ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``; dk/dv summed over
    each GQA group."""
    return _backward(grad, q, k, v, out, mask, stats, is_causal, scale, log_n, qk_norm, p, precise)


@triton_softplus_attention_backward_op.register_fake
def _(grad, q, k, v, out, mask, stats, is_causal, scale, log_n, qk_norm, p, precise):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, out, mask, stats)
    ctx.args = (is_causal, scale, log_n, qk_norm, p, precise)
    ctx.mark_non_differentiable(stats)


def _autograd_backward(ctx, grad, _grad_stats):
    q, k, v, out, mask, stats = ctx.saved_tensors
    dq, dk, dv = triton_softplus_attention_backward_op(
        grad.contiguous(), q, k, v, out, mask, stats, *ctx.args
    )
    return dq, dk, dv, None, None, None, None, None, None, None


triton_softplus_attention_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_attention(
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
    precise: bool = True,
) -> Tensor:
    """Fused softplus-l1 attention (lssa, lssar, softplus-l1; any ``p``) on Triton.

    Same contract as :func:`lssar.ops.reference.reference_attention`:
    ``query (B, H_q, T_q, D)``, ``key (B, H_kv, T_k, D)``, ``value (B, H_kv, T_k, D_v)`` ->
    ``(B, H_q, T_q, D_v)`` in the input dtype. ``attn_mask`` is boolean (True = may attend),
    broadcastable to ``(B, H_q, T_q, T_k)``, combinable with ``is_causal`` (bottom-right aligned).
    Rows with no visible key are 0 with 0 gradients. Needs CUDA tensors, or ``TRITON_INTERPRET=1``
    for CPU tensors; float64 inputs run on :func:`lssar.ops.chunked.chunked_attention`.
    ``precise=False`` trades half-precision accuracy for speed (see the module docstring).
    """
    if dropout_p > 0:
        raise ValueError("impl='triton' has no dropout; use impl='reference' for dropout_p > 0")
    if not variant.softplus_l1:
        raise ValueError(f"impl='triton' runs the softplus-l1 variants, not {variant.name!r}")
    check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.dtype == torch.float64:
        from lssar.ops.chunked import chunked_attention

        return chunked_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            variant=variant, options=options,
        )  # fmt: skip
    if not query.is_cuda and not _interpreting():
        raise RuntimeError(
            f"impl='triton' needs a CUDA device or TRITON_INTERPRET=1 (got {query.device} "
            "tensors; the variable must be set before triton is first imported)"
        )
    d, dv = query.shape[-1], value.shape[-1]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"impl='triton' supports head dims up to {MAX_HEAD_DIM}, got {d}, {dv}")
    c, log_n = variant.softplus_scale(d, scale)
    p = options.get("p")
    if variant.qk_norm:  # divide by the largest entry first: the in-kernel norm then sees
        # |x| in [1, sqrt(D)] (no eps, no overflow) at every scale; exact, the cosine is invariant
        query, key = _unit_scale(query), _unit_scale(key)
    out, _ = triton_softplus_attention_op(
        query,
        key,
        value,
        attn_mask,
        bool(is_causal),
        float(c),
        log_n,
        bool(variant.qk_norm),
        None if p is None else float(p),
        bool(precise),
    )
    return out


def _supports(variant: Variant, options: dict[str, Any]) -> bool:
    return variant.softplus_l1


register_impl(
    "triton",
    triton_attention,
    _supports,
    "fused Triton kernels for the softplus-l1 family (lssa, lssar, softplus-l1; any p); "
    "CUDA, or CPU with TRITON_INTERPRET=1",
)

__all__ = ["triton_attention", "triton_softplus_attention_op"]
