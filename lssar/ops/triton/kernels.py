"""Device code of ``impl="triton"``: the jitted kernels and their autotuning configurations.

One module, over ~600 lines, on purpose for now: the four kernels share their device functions
and one autotuning key, and the pruning (``fits``, ``MEASURED_SPILLS``) is keyed by those
kernels' names. The autotuning section is the next split (issue #23's closing note).

FlashAttention-2-style kernels for the softplus-l1 family (lssa, lssar, softplus-l1; any ``p``).
The math is METHOD.md sections 3-5 and mirrors :mod:`lssar.ops.chunked` exactly (mean-centred
``x = softplus(s) - mu_i``, ``mu_i = Z_i / N_i`` for ``N_i > REWEIGHT_MIN_KEYS``,
``r = x / x_max``, LSSA weights for rows whose ``x`` are all within ``uniform_tolerance * mu_i``,
zeros for rows with ``N_i = 0``). Only the schedule differs:

forward (programs: query blocks x batch*heads on a 1-D grid; the ``T_q x T_k`` scores never exist)
    LSSA: one pass over the key blocks accumulating ``sum_j softplus(s_ij) v_j`` and ``Z_i``
    (Softplus needs no running max, so there is no rescaling as in softmax).
    LSSAR: pass 1 gives ``Z_i`` and ``m_i = max_j s_ij``; Softplus is monotone, so
    ``x_max = softplus(m_i) - mu_i`` (un-centred ``softplus(m_i)`` when
    ``N_i <= REWEIGHT_MIN_KEYS``); pass 2 accumulates ``r^p v`` and ``W_i = sum_j r^p`` with
    ``r in [0, 1]`` (no overflow). Per-row statistics ``(N, mu, x_max, W)`` (fp32, ``x_max = 0``
    marks the LSSA fallback) are kept for the backward.
backward (deterministic, no atomics)
    rows kernel: ``D_i = sum_j P_ij dP_ij`` and ``F_i = sum_j dx_ij`` in one pass over the keys
    (LSSA: ``D_i = g_i . out_i`` and no pass); dq kernel over key blocks per query block; dk/dv
    kernel over query blocks (and the ``H_q / H_kv`` query heads of a GQA group) per key block.

key spans (``HAS_SPANS``; :mod:`lssar.ops.spans`: packed documents, sliding windows, sink tokens,
the causal rule folded in by the host)
    row ``i`` sees keys ``[lo_i, hi_i)`` and, with ``HAS_SINKS``, ``[slo_i, shi_i)`` (int32 planes
    from the host). A program over a block of rows (forward, both LSSAR passes; rows; dq) loops
    only over the key blocks of the hulls of its rows' spans, the sinks' and the window's walked
    as one loop that skips the blocks between them (:func:`_span_blocks`); a dk/dv program only
    over the query blocks of the hull of its keys' row ranges (computed on the host, where no
    monotonicity of the bounds is assumed). Without spans (constexpr) none of it is compiled in.

``q . k`` is accumulated in fp32 from the raw inputs and scaled by fp32 inverse norms (computed
on the host); statistics and accumulators are fp32 for every input dtype; fp32 inputs use IEEE
fp32 dots (no TF32). ``SPLIT`` feeds fp32 weights / score gradients to the tensor cores as a
``hi + lo`` pair in the input dtype (see :mod:`lssar.ops.triton.host`, ``precise``). Softplus is
``max(s, 0) + log1p(exp(-|s|))`` with a two-MUFU log1p.

Why one module of ~600 lines: the four kernels share the device functions above them and one
autotuning key; the host side (launch, custom ops, the public function) is
:mod:`lssar.ops.triton.host`. ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
imported (``triton.jit``, here and in ``triton.language``'s own helpers such as ``tl.zeros``,
picks compiled or interpreted code when a function is decorated); :data:`INTERPRETED` records
which it picked.
"""

from typing import Any

import triton
import triton.language as tl

from lssar.ops.common import REWEIGHT_MIN_KEYS

# rows with more visible keys than this are mean-centred (O_i = 1); a constexpr global, as Triton
# requires, of the one definition in lssar.ops.common
MIN_KEYS = tl.constexpr(float(REWEIGHT_MIN_KEYS))

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
    Mblk,
    smq,
    smk,
    Tq,
    Tk,
    off,
    lo,
    hi,
    slo,
    shi,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    QK_NORM: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SPANS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # s_ij = c_i * (q_i . k_j) / (|q_i| |k_j|), fp32 (BM, BN), and its visibility (spans: key j
    # in the row's [lo, hi) or [slo, shi); they lie in [0, Tk), and rows past Tq have empty ones,
    # so no bounds test is needed then).
    s = _dot(q, tl.trans(k), IEEE, UPCAST) * cq[:, None]
    if QK_NORM:
        s = s * ik[None, :]
    if HAS_SPANS:
        j = offs_n[None, :]
        vis = (j >= lo[:, None]) & (j < hi[:, None])
        if HAS_SINKS:
            vis = vis | ((j >= slo[:, None]) & (j < shi[:, None]))
    else:
        vis = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= offs_m[:, None] + off)
    if HAS_MASK:
        allowed = tl.load(
            Mblk
            + tl.arange(0, q.shape[0])[:, None] * smq
            + tl.arange(0, k.shape[0])[None, :] * smk,
            mask=vis,
            other=0,
        )
        vis = vis & (allowed != 0)
    return s, vis


@triton.jit
def _rows_at(P, start, stride, B: tl.constexpr):
    # pointers to rows start .. start + B - 1 (B, 1) of a plane with row stride `stride`: the
    # block offset in int64 on the scalar base (T x stride, T_q x T_k for a dense mask, can pass
    # 2^31), the in-block offsets in int32 (int64 offsets per element cost registers: spills).
    return P + tl.cast(start, tl.int64) * stride + tl.arange(0, B)[:, None] * stride


@triton.jit
def _at(P, i, j, si, sj):
    # scalar pointer to element (i, j) of a plane, in int64
    return P + tl.cast(i, tl.int64) * si + tl.cast(j, tl.int64) * sj


@triton.jit
def _program(T, B: tl.constexpr):
    # (block, batch*head) from a 1-D grid of cdiv(T, B) * batch*heads programs. The block index
    # varies fastest, as on a (blocks, batch*heads) grid (one head's programs run together and
    # share its K/V in L2), but batch*heads is not bound by grid axis 1's limit of 65,535.
    pid = tl.program_id(0)
    nblk = tl.cdiv(T, B)
    return pid % nblk, (pid // nblk).to(tl.int64)


@triton.jit
def _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr):
    # the rows' key spans [lo, hi) and sink spans [slo, shi), int32 (BM,) from the host's
    # (2|4, T_q) plane SP (rows past T_q: empty); without spans, placeholders that are never read
    if HAS_SPANS:
        lo = tl.load(SP + offs_m, mask=rmask, other=0)
        hi = tl.load(SP + Tq + offs_m, mask=rmask, other=0)
        if HAS_SINKS:
            slo = tl.load(SP + 2 * Tq + offs_m, mask=rmask, other=0)
            shi = tl.load(SP + 3 * Tq + offs_m, mask=rmask, other=0)
        else:
            slo = lo
            shi = lo
    else:
        lo = offs_m
        hi = offs_m
        slo = offs_m
        shi = offs_m
    return lo, hi, slo, shi


@triton.jit
def _span_blocks(lo, hi, slo, shi, Tk, BN: tl.constexpr, HAS_SINKS: tl.constexpr):
    # The key blocks some row of the block sees: the window blocks [w0, w1) and, with sinks, the
    # sink blocks [s0, s1) (block-aligned hulls over the rows with a non-empty span), walked as
    # one loop: `for it in range(start, end, BN)` at key offset _skip_gap(it, split, shift), so a
    # block in both is visited once and the blocks between the two are skipped.
    live = hi > lo
    w0 = tl.min(tl.where(live, lo, Tk), 0) // BN * BN
    w1 = tl.cdiv(tl.max(tl.where(live, hi, 0), 0), BN) * BN
    if HAS_SINKS:
        slive = shi > slo
        s0 = tl.min(tl.where(slive, slo, Tk), 0) // BN * BN
        s1 = tl.cdiv(tl.max(tl.where(slive, shi, 0), 0), BN) * BN
        w_on = w1 > w0
        s_on = s1 > s0
        # an empty hull becomes a zero-length one at the other's start (or at 0)
        w0 = tl.where(w_on, w0, tl.where(s_on, s0, 0))
        w1 = tl.where(w_on, w1, w0)
        s0 = tl.where(s_on, s0, w0)
        s1 = tl.where(s_on, s1, s0)
        swap = s0 < w0  # the sink hull comes first
        f0 = tl.minimum(w0, s0)
        f1 = tl.where(swap, s1, w1)
        g0 = tl.where(swap, w0, s0)
        g1 = tl.where(swap, w1, s1)
        c0 = tl.maximum(g0, f1)  # the second hull's blocks not in the first
        end = f1 + tl.maximum(g1 - c0, 0)
        start = f0
        split = f1
        shift = c0 - f1
    else:
        start = w0
        end = w1
        split = w1
        shift = 0
    return start, end, split, shift


@triton.jit
def _skip_gap(it, split, shift, HAS_SINKS: tl.constexpr):
    # key offset of loop step `it` of _span_blocks' walk (the identity without sinks)
    if HAS_SINKS:
        it = it + tl.where(it >= split, shift, 0)
    return it


@triton.jit
def _span_query_rows(KR, offs_n, kmask, Tq, Tk, BM: tl.constexpr):
    # the query rows that may see some key of the block: the hull of the host's per-key row
    # ranges [KR[j], KR[Tk + j]), aligned down to a row block; (Tq, 0)-like when none
    r0 = tl.load(KR + offs_n, mask=kmask, other=0)
    r1 = tl.load(KR + Tk + offs_n, mask=kmask, other=0)
    live = r1 > r0
    m0 = tl.min(tl.where(live, r0, Tq), 0) // BM * BM
    m1 = tl.max(tl.where(live, r1, 0), 0)
    return m0, m1


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
def fwd_kernel(
    Q, K, V, O, ST, IQ, IK, M, SP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid_m, pid_bh = _program(Tq, BM)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    q = tl.load(
        _rows_at(Q + b * sqb + h * sqh, pid_m * BM, sqt, BM) + offs_d[None, :],
        mask=rmask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    n = tl.load(ST + rows, mask=rmask, other=0.0)
    cq = _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    IKb = IK + (b * (H // G) + hk) * Tk
    Mb = M + b * smb + h * smh
    lo, hi, slo, shi = _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS, HAS_SINKS)
    k_lo = 0
    k_hi = Tk
    if CAUSAL:  # the block's last row sees keys up to off + (pid_m + 1) * BM - 1
        k_hi = tl.minimum(Tk, off + (pid_m + 1) * BM)
    split = k_hi
    shift = 0
    if HAS_SPANS:  # only the key blocks the rows' spans reach (LSSAR: both passes)
        k_lo, k_hi, split, shift = _span_blocks(lo, hi, slo, shi, Tk, BN, HAS_SINKS)

    mu = tl.zeros((BM,), tl.float32)
    xmax = tl.zeros((BM,), tl.float32)
    if REWEIGHT:
        z = tl.zeros((BM,), tl.float32)
        mx = tl.full((BM,), float("-inf"), tl.float32)
        for it in range(k_lo, k_hi, BN):
            start_n = _skip_gap(it, split, shift, HAS_SINKS)
            offs_n = start_n + tl.arange(0, BN)
            kmask = offs_n < Tk
            k = tl.load(
                _rows_at(Kb, start_n, skt, BN) + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
            s, vis = _scores(
                q, k, cq, ik, offs_m, offs_n, _at(Mb, pid_m * BM, start_n, smq, smk),
                smq, smk, Tq, Tk, off, lo, hi, slo, shi,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
            )  # fmt: skip
            z += tl.sum(tl.where(vis, _softplus(s), 0.0), 1)
            mx = tl.maximum(mx, tl.max(tl.where(vis, s, float("-inf")), 1))
        mu = tl.where(n > MIN_KEYS, z / tl.maximum(n, 1.0), 0.0)
        # softplus is monotone: the row's largest x is softplus(max s) - mu (0 for empty rows);
        # deviations within tol * mu of the mean are rounding noise: a uniform row, LSSA weights
        xmax = tl.maximum(_softplus(mx) - mu, 0.0)
        xmax = tl.where(xmax > tol * mu, xmax, 0.0)
    has = xmax > 0
    inv_xmax = 1.0 / tl.where(has, xmax, 1.0)

    acc = tl.zeros((BM, BDV), tl.float32)
    wsum = tl.zeros((BM,), tl.float32)
    for it in range(k_lo, k_hi, BN):
        start_n = _skip_gap(it, split, shift, HAS_SINKS)
        offs_n = start_n + tl.arange(0, BN)
        kmask = offs_n < Tk
        k = tl.load(
            _rows_at(Kb, start_n, skt, BN) + offs_d[None, :],
            mask=kmask[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
        s, vis = _scores(
            q, k, cq, ik, offs_m, offs_n, _at(Mb, pid_m * BM, start_n, smq, smk),
            smq, smk, Tq, Tk, off, lo, hi, slo, shi,
            CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
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
            _rows_at(Vb, start_n, svt, BN) + offs_dv[None, :],
            mask=kmask[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        acc += _dot_lp(w, v, IEEE, UPCAST, SPLIT)
    out = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
    tl.store(
        _rows_at(O + b * sob + h * soh, pid_m * BM, sot, BM) + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=rmask[:, None] & (offs_dv[None, :] < DV),
    )
    tl.store(ST + plane + rows, mu, mask=rmask)
    tl.store(ST + 2 * plane + rows, xmax, mask=rmask)
    tl.store(ST + 3 * plane + rows, wsum, mask=rmask)


@triton.jit
def bwd_rows_kernel(
    Q, K, V, O, GO, ST, DF, IQ, IK, M, SP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sgb, sgh, sgt,
    smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # D_i = sum_j P_ij dP_ij and F_i = sum_j dx_ij. For LSSAR both come from one pass over the
    # keys with the same fp32 P as the dq/dk/dv kernels (not from the rounded output):
    # F_i = p / (W x_max) * (sum_j r^(p-1) dP_ij - D_i sum_j r^(p-1)).
    pid_m, pid_bh = _program(Tq, BM)
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
        _rows_at(GO + b * sgb + h * sgh, pid_m * BM, sgt, BM) + offs_dv[None, :],
        mask=gmask,
        other=0.0,
    )
    f = tl.zeros((BM,), tl.float32)
    if REWEIGHT:
        q = tl.load(
            _rows_at(Q + b * sqb + h * sqh, pid_m * BM, sqt, BM) + offs_d[None, :],
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
        lo, hi, slo, shi = _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS, HAS_SINKS)
        k_lo = 0
        k_hi = Tk
        if CAUSAL:
            k_hi = tl.minimum(Tk, off + (pid_m + 1) * BM)
        split = k_hi
        shift = 0
        if HAS_SPANS:
            k_lo, k_hi, split, shift = _span_blocks(lo, hi, slo, shi, Tk, BN, HAS_SINKS)
        dsum = tl.zeros((BM,), tl.float32)
        s1 = tl.zeros((BM,), tl.float32)
        s2 = tl.zeros((BM,), tl.float32)
        for it in range(k_lo, k_hi, BN):
            start_n = _skip_gap(it, split, shift, HAS_SINKS)
            offs_n = start_n + tl.arange(0, BN)
            kmask = offs_n < Tk
            k = tl.load(
                _rows_at(Kb, start_n, skt, BN) + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
            v = tl.load(
                _rows_at(Vb, start_n, svt, BN) + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )
            s, vis = _scores(
                q, k, cq, ik, offs_m, offs_n, _at(Mb, pid_m * BM, start_n, smq, smk),
                smq, smk, Tq, Tk, off, lo, hi, slo, shi,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
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
            _rows_at(O + b * sob + h * soh, pid_m * BM, sot, BM) + offs_dv[None, :],
            mask=gmask,
            other=0.0,
        )
        d = tl.sum(go.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DF + rows, d, mask=rmask)
    tl.store(DF + plane + rows, f, mask=rmask)


@triton.jit
def bwd_dq_kernel(
    Q, K, V, GO, ST, DF, IQ, IK, M, SP, DQ,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # dq_fix_i = sum_j ds_ij c_i / (|q_i| |k_j|) k_j (gradient at fixed norms), fp32 (B,H,Tq,BD).
    pid_m, pid_bh = _program(Tq, BM)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    q = tl.load(
        _rows_at(Q + b * sqb + h * sqh, pid_m * BM, sqt, BM) + offs_d[None, :],
        mask=rmask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    go = tl.load(
        _rows_at(GO + b * sgb + h * sgh, pid_m * BM, sgt, BM) + offs_dv[None, :],
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
    fn = tl.where(n > MIN_KEYS, f / tl.maximum(n, 1.0), 0.0)  # the mean-centring term F_i / N_i
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    IKb = IK + (b * (H // G) + hk) * Tk
    Mb = M + b * smb + h * smh
    lo, hi, slo, shi = _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS, HAS_SINKS)
    k_lo = 0
    k_hi = Tk
    if CAUSAL:
        k_hi = tl.minimum(Tk, off + (pid_m + 1) * BM)
    split = k_hi
    shift = 0
    if HAS_SPANS:
        k_lo, k_hi, split, shift = _span_blocks(lo, hi, slo, shi, Tk, BN, HAS_SINKS)
    dq = tl.zeros((BM, BD), tl.float32)
    for it in range(k_lo, k_hi, BN):
        start_n = _skip_gap(it, split, shift, HAS_SINKS)
        offs_n = start_n + tl.arange(0, BN)
        kmask = offs_n < Tk
        k = tl.load(
            _rows_at(Kb, start_n, skt, BN) + offs_d[None, :],
            mask=kmask[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        ik = tl.load(IKb + offs_n, mask=kmask, other=0.0)
        v = tl.load(
            _rows_at(Vb, start_n, svt, BN) + offs_dv[None, :],
            mask=kmask[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        s, vis = _scores(
            q, k, cq, ik, offs_m, offs_n, _at(Mb, pid_m * BM, start_n, smq, smk),
            smq, smk, Tq, Tk, off, lo, hi, slo, shi,
            CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
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
def bwd_dkdv_kernel(
    Q, K, V, GO, ST, DF, IQ, IK, M, SP, KR, DK, DVO,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # One key block of one kv head; loops over the G query heads of its GQA group and over the
    # query blocks that can see it, so dk/dv are summed in registers (deterministic).
    pid_n, pid_bk = _program(Tk, BN)
    HK = H // G
    b = pid_bk // HK
    hk = pid_bk % HK
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    kmask = offs_n < Tk
    k = tl.load(
        _rows_at(K + b * skb + hk * skh, pid_n * BN, skt, BN) + offs_d[None, :],
        mask=kmask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    v = tl.load(
        _rows_at(V + b * svb + hk * svh, pid_n * BN, svt, BN) + offs_dv[None, :],
        mask=kmask[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    ik = tl.load(IK + pid_bk * Tk + offs_n, mask=kmask, other=0.0)
    m_lo = 0
    m_hi = Tq
    if CAUSAL:  # query i sees key j iff j <= off + i: rows before n0 - off cannot see this block
        m_lo = (tl.maximum(pid_n * BN - off, 0) // BM) * BM
    if HAS_SPANS:  # only the row blocks whose spans may reach this key block
        m_lo, m_hi = _span_query_rows(KR, offs_n, kmask, Tq, Tk, BM)
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BDV), tl.float32)
    for g in range(G):
        h = hk * G + g
        bh = b * H + h
        Qb = Q + b * sqb + h * sqh
        GOb = GO + b * sgb + h * sgh
        Mb = M + b * smb + h * smh
        for start_m in range(m_lo, m_hi, BM):
            offs_m = start_m + tl.arange(0, BM)
            rmask = offs_m < Tq
            lo, hi, slo, shi = _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS, HAS_SINKS)
            rows = bh * Tq + offs_m
            q = tl.load(
                _rows_at(Qb, start_m, sqt, BM) + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            go = tl.load(
                _rows_at(GOb, start_m, sgt, BM) + offs_dv[None, :],
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
            fn = tl.where(n > MIN_KEYS, f / tl.maximum(n, 1.0), 0.0)
            s, vis = _scores(
                q, k, cq, ik, offs_m, offs_n, _at(Mb, start_m, pid_n * BN, smq, smk),
                smq, smk, Tq, Tk, off, lo, hi, slo, shi,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
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
INTERPRETED = not isinstance(fwd_kernel, triton.runtime.JITFunction)

# ----------------------------------------------------------------------------- autotuning

_TUNE_KEY = [
    "tq_key", "tk_key", "BD", "BDV", "CAUSAL", "HAS_MASK", "REWEIGHT", "P_INT", "SPLIT",
    "HAS_SPANS", "HAS_SINKS",
]  # fmt: skip


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BM": m, "BN": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


# Every config is checked ahead of time by ``python -m lssar.ops.triton.compile_check`` (sm_80 and
# sm_90: registers, spills, shared memory; tests/test_triton_compile.py); the limits below are
# set from its measurements, a little inside the first spilling tile of each kernel.
SHARED_BUDGET = 163 * 1024  # sm_80's per-block maximum, the smallest of the supported GPUs
# Live fp32 words per thread (_live_words) above which ptxas spilled, per kernel. Examples:
# forward at head dim 128: 64x32 tile, 4 warps: 64 + 3 * 16 = 112 words, spills; 64x64, 8 warps:
# 80, does not; dk/dv at 256, 64x32, 8 warps: 152, spills; at 128, 32x32, 4 warps: 120, does
# not. Tiles within the limits that spilled anyway are listed in MEASURED_SPILLS.
REG_BUDGET = {"fwd": 80, "rows": 48, "dq": 80, "dkdv": 120}
# fp32 inputs multiply on FMA units (IEEE, no tensor cores): each thread then holds a slice of
# both operands, which spills at any tile above a few score elements per thread (measured: 2 fit
# at head dim 256; 4 spill there with a mask, and by 4 B at 128). dk/dv's transposed FMA products
# spill at every tile when software pipelined (num_stages > 1), even 16x16; unpipelined, one
# score per thread fits at 256.
FMA_SCORES_PER_THREAD = {"fwd": 2, "rows": 2, "dq": 2, "dkdv": 1}


def _live_words(kind: str, bm: int, bn: int, warps: int, bd: int, bdv: int) -> float:
    """Estimated live fp32 words per thread in a kernel's loop: its fp32 accumulators and ~3
    score-shaped fp32 tiles (scores, weights, dP / dS); dk/dv also reloads q and dO tiles (two
    half-precision values per word) every iteration."""
    threads = 32 * warps
    acc = {"fwd": bm * bdv, "rows": 0, "dq": bm * bd, "dkdv": bn * (bd + bdv)}[kind]
    reloaded = bm * (bd + bdv) / 2 if kind == "dkdv" else 0
    return (acc + reloaded + 3 * bm * bn) / threads


def _shared_bytes(kind: str, bm: int, bn: int, stages: int, bd: int, bdv: int, esize: int) -> int:
    """Estimated shared memory per block: the pipelined tiles of the loop (``stages`` copies of
    k, v; or q, dO for dk/dv) and the resident ones (what sm_90's wgmma reads from shared)."""
    if kind == "dkdv":
        return (stages * bm + bn) * (bd + bdv) * esize
    resident = bm * bd if kind == "fwd" else bm * (bd + bdv)
    return (stages * bn * (bd + bdv) + resident) * esize


# Tiles inside those limits that ptxas still spilled (a few bytes to a few hundred; it sometimes
# caps a 256-thread block at 128 registers), per (kernel, padded head dim, fp32 inputs, BM, BN,
# num_warps, num_stages), measured by compile_check on sm_80 and sm_90 (LSSAR p=15 and LSSA,
# causal or not, with and without a mask): the kernels sit near 255 registers at most tiles.
MEASURED_SPILLS = {
    ("fwd", 64, False, 64, 32, 4, 2),
    ("fwd", 128, False, 64, 64, 8, 3),
    ("fwd", 128, False, 16, 64, 4, 2),
    ("fwd", 256, False, 16, 64, 4, 2),
    ("fwd", 256, False, 16, 32, 4, 2),
    ("rows", 128, False, 128, 32, 8, 2),
    ("rows", 128, False, 64, 64, 8, 3),
    ("rows", 128, False, 64, 64, 8, 2),
    ("rows", 128, False, 64, 32, 8, 2),
    ("dq", 64, False, 64, 64, 8, 3),
    ("dq", 64, False, 64, 64, 8, 2),
    ("dq", 128, False, 64, 64, 8, 3),
    ("dq", 128, False, 64, 64, 8, 2),
    ("dq", 256, False, 16, 64, 4, 2),
    ("dkdv", 64, False, 32, 64, 8, 2),
    ("dkdv", 64, False, 64, 32, 4, 2),
    ("dkdv", 64, False, 64, 32, 8, 2),
    ("dkdv", 128, False, 64, 32, 8, 2),
    ("dkdv", 128, False, 32, 32, 8, 2),
    ("dkdv", 256, False, 32, 32, 8, 2),
    ("dkdv", 256, False, 16, 16, 4, 2),
}
# Tiles that spilled only with key spans (HAS_SPANS: the rows' bounds and the data-dependent loop
# bounds hold a few more registers), measured on the spans cases lssar d64/d128/d256 bf16, lssar
# d128 fp32 (window + sinks), lssa d128 bf16 (window + sinks), lssar d128 bf16 (window), sm_80
# and sm_90 (4 to 124 B). Not listed: fp32 rows d128 16x16 w4 s2 (8 B on sm_80 with sinks), the
# only tile the FMA rule keeps there.
MEASURED_SPAN_SPILLS = {
    ("fwd", 128, False, 64, 64, 8, 2),
    ("dq", 64, False, 64, 32, 4, 2),
    ("rows", 256, False, 16, 64, 4, 2),
    ("dkdv", 128, False, 16, 16, 8, 1),
    ("dkdv", 256, False, 16, 16, 8, 1),
}


def fits(kind: str, cfg: triton.Config, bd: int, bdv: int, ieee: bool, spans: bool = False) -> bool:
    """Whether ``cfg`` is expected to run without register spills within shared memory for a
    ``kind`` kernel ("fwd", "rows", "dq", "dkdv") at padded head dims ``bd``, ``bdv``; ``ieee``:
    fp32 inputs (4-byte tiles, FMA dots); ``spans``: launched with key spans (``HAS_SPANS``)."""
    bm, bn = cfg.kwargs["BM"], cfg.kwargs["BN"]
    w, st = cfg.num_warps, cfg.num_stages
    key = (kind, max(bd, bdv), ieee, bm, bn, w, st)
    if key in MEASURED_SPILLS or (spans and key in MEASURED_SPAN_SPILLS):
        return False
    if _shared_bytes(kind, bm, bn, st, bd, bdv, 4 if ieee else 2) > SHARED_BUDGET:
        return False
    if ieee:
        piped_ok = kind != "dkdv" or st == 1
        return piped_ok and bm * bn <= FMA_SCORES_PER_THREAD[kind] * 32 * w
    return _live_words(kind, bm, bn, w, bd, bdv) <= REG_BUDGET[kind]


def _pruner(kind: str):
    """The autotuner's ``early_config_prune`` for a ``kind`` kernel: drops configs that would
    spill or not fit (:func:`fits`), and row tiles taller than the query block (decoding,
    ``T_q = 1``: saves tuning time). Never returns an empty list: if nothing fits, the config
    with the fewest estimated live words."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list:
        bd, bdv, ieee = kwargs["BD"], kwargs["BDV"], kwargs["IEEE"]
        spans = bool(kwargs.get("HAS_SPANS", False))
        kept = [c for c in configs if fits(kind, c, bd, bdv, ieee, spans)]
        if kind != "dkdv":
            tq = named_args.get("tq_key", kwargs.get("tq_key", 1 << 30))
            short = [c for c in kept if c.kwargs["BM"] <= max(16, tq)]
            kept = short or kept[-1:]
        if not kept:
            kw = lambda c: _live_words(kind, c.kwargs["BM"], c.kwargs["BN"], c.num_warps, bd, bdv)  # noqa: E731
            kept = [min(configs, key=kw)]
        return kept

    return prune


# Row-parallel kernels (forward, rows, dq): tall query tiles; key-parallel dk/dv: tall key tiles.
# Large tiles first (the autotuner weighs those that fit at the launch's head dim and dtype),
# then the small ones that fit at head dim 256 and with fp32 inputs. On sm_90 a 64-row tile with
# 8 warps computes its element-wise work twice (both warpgroups hold the whole tile: twice the
# MUFU and ALU instructions per score in the SASS), so 64-row tiles with 4 warps come first.
_ROW_CONFIGS = _configs(
    [
        (128, 32, 8, 2),
        (64, 32, 4, 2),
        (64, 64, 8, 3),
        (64, 64, 8, 2),
        (64, 32, 8, 2),
        (16, 64, 4, 2),
        (16, 32, 4, 2),
        (16, 16, 4, 2),
    ]
)
_COL_CONFIGS = _configs(
    [
        (32, 64, 8, 2),
        (64, 32, 8, 2),
        (32, 32, 4, 2),
        (64, 32, 4, 2),
        (32, 32, 8, 2),
        (16, 32, 8, 2),
        (16, 32, 4, 2),
        (16, 16, 4, 2),
        (16, 16, 8, 1),
    ]
)


def _tuned(kernel, configs: list[triton.Config], kind: str):
    prune = {"early_config_prune": _pruner(kind)}
    return triton.autotune(configs, key=_TUNE_KEY, prune_configs_by=prune)(kernel)


fwd_tuned = _tuned(fwd_kernel, _ROW_CONFIGS, "fwd")
rows_tuned = _tuned(bwd_rows_kernel, _ROW_CONFIGS, "rows")
dq_tuned = _tuned(bwd_dq_kernel, _ROW_CONFIGS, "dq")
dkdv_tuned = _tuned(bwd_dkdv_kernel, _COL_CONFIGS, "dkdv")
