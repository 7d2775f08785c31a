"""Device code of ``impl="triton"``: the jitted kernels and the device functions they share.

Device code only. The autotuning (the configurations, the pruning ``fits`` with
``MEASURED_SPILLS``, the autotuning key, ``prune_configs_by`` and the
autotuned launchers ``fwd_tuned`` .. ``dkdv_tuned``) is :mod:`lssar.ops.triton.autotune`, once
part of this module; the host side (launch, custom ops, the public function) is
:mod:`lssar.ops.triton.host`. At ~830 lines the device code stays one module: the four kernels
share the jitted device functions (the dot, softplus, the weight rule, the span bounds) that
Triton resolves from this module's globals.

FlashAttention-2-style kernels for the softplus-l1 family (lssa, lssar, softplus-l1; any ``p``).
The math is docs/method.md sections 3-5 and mirrors :mod:`lssar.ops.chunked` exactly (mean-centred
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
    kernel over query blocks (and the ``H_q / H_kv`` query heads of a GQA group) per key block
    (or per key block and gradient: ``ONE_GRAD``, one program for dk and one for dv).

key spans (``HAS_SPANS``; :mod:`lssar.ops.spans`: packed documents, sliding windows, sink tokens,
the causal rule folded in by the host)
    row ``i`` sees keys ``[lo_i, hi_i)`` and, with ``HAS_SINKS``, ``[slo_i, shi_i)`` (int32 planes
    from the host). A program over a block of rows (forward, both LSSAR passes; rows; dq) loops
    only over the key blocks of the hulls of its rows' spans, the sinks' and the window's walked
    as one loop that skips the blocks between them (:func:`_span_blocks`); a dk/dv program only
    over the query blocks of the hull of its keys' row ranges (computed on the host, where no
    monotonicity of the bounds is assumed). Without spans (constexpr) none of it is compiled in.

``q . k`` is accumulated in fp32 from the raw inputs and scaled by fp32 inverse norms (host);
statistics and accumulators are fp32 for every input dtype; fp32 inputs use IEEE fp32 dots, or
TF32 tensor cores (``IEEE=False``) where torch allows TF32 (see the host). ``SPLIT`` feeds fp32
weights / score gradients to the tensor cores as a ``hi + lo`` pair in the input dtype (host,
``precise``). Softplus is ``max(s, 0) + log1p(exp2(-|s| log2 e))``: one EX2, a polynomial log1p.

One module for the four kernels: they share the device functions above them (the compile check's
cache is keyed by this source, line numbers included: host-side edits belong in the autotune or
host module). ``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported
(``triton.jit``, here and in ``triton.language``'s own helpers such as ``tl.zeros``, picks
compiled or interpreted code when a function is decorated); :data:`INTERPRETED` records which it
picked.
"""

import triton
import triton.language as tl

from lssar.ops.common import REWEIGHT_MIN_KEYS

# rows with more visible keys than this are mean-centred (O_i = 1); a constexpr global, as Triton
# requires, of the one definition in lssar.ops.common
MIN_KEYS = tl.constexpr(float(REWEIGHT_MIN_KEYS))

# ----------------------------------------------------------------------------- device functions


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # IEEE: exact fp32 dots for fp32 inputs; False lets them round to tf32 (host: allow_tf32).
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
    # softplus(s) = max(s, 0) + log1p(u), u = 2^(-|s| log2 e) in (0, 1]: one MUFU.EX2 (exp2 is
    # ex2.approx.ftz; tl.exp adds a subnormal guard: 3 more instructions; u flushes to 0 below
    # s = -87.3 instead of -103). log1p(u) = u * P(u), P a degree-8 fit of log1p(u) / u on
    # [0, 1] (relative error 2.6e-8; <= 2.4 ulp in fp32 Horner, measured against float64 over u
    # in [2^-40, 1]): 9 FMA-class instructions instead of libdevice's logf (~20, no MUFU: Triton
    # 3.9 lowers tl.log and tl.log2 to __nv_logf / __nv_log2f, not lg2.approx) plus a correction.
    # No lg2.approx: its error is 2^-22 absolute on [0.5, 2], i.e. relative 1.7e-7 / log1p(u):
    # 4e-3 at s = -10. w = 1 + u is for the sigmoid only (unused lanes are dead code).
    u = tl.exp2(tl.abs(s) * -1.4426950408889634)
    c = 0.005383966024965048 * u - 0.030110584571957588
    c = c * u + 0.07921013236045837
    c = c * u - 0.1374657154083252
    c = c * u + 0.19145092368125916
    c = c * u - 0.24852940440177917
    c = c * u + 0.33320343494415283
    c = c * u - 0.49999552965164185
    c = c * u + 1.0
    return tl.maximum(s, 0.0) + c * u, u, 1.0 + u


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
    KEY_MAJOR: tl.constexpr,
):
    # s_ij = c_i * (q_i . k_j) / (|q_i| |k_j|), fp32 (BM, BN), and its visibility (spans: key j
    # in the row's [lo, hi) or [slo, shi); they lie in [0, Tk), and rows past Tq have empty ones,
    # so no bounds test is needed then). KEY_MAJOR: the product taken as k q^T (M = BN, the
    # dk/dv kernel's tall side: sm_90's wgmma needs M % 64 == 0) and transposed in registers.
    if KEY_MAJOR:
        s = tl.trans(_dot(k, tl.trans(q), IEEE, UPCAST)) * cq[:, None]
    else:
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
        # predicated on the bounds only, not on `vis`: the predicate is then constant along
        # contiguous keys, so the mask tile can load as vectors (one address per vector, not a
        # 64-bit address and a predicate per score); measured on 192 masked half-precision
        # builds: up to 60 fewer registers, 4 spilling builds before and none after
        allowed = tl.load(
            Mblk
            + tl.arange(0, q.shape[0])[:, None] * smq
            + tl.arange(0, k.shape[0])[None, :] * smk,
            mask=(offs_m[:, None] < Tq) & (offs_n[None, :] < Tk),
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
def _probs(a, vis, mu, inv_xmax, has, winv, p, P_INT: tl.constexpr, REWEIGHT):
    # P_ij (zero where not visible) and r^(p-1) (LSSAR; LSSA: a placeholder, unused)
    if REWEIGHT:
        w, rpm1 = _sharpen(a, mu, inv_xmax, p, P_INT)
        w = tl.where(has[:, None], w, a)
    else:
        w = a
        rpm1 = a
    return tl.where(vis, w * winv[:, None], 0.0), rpm1


@triton.jit
def _probs_dscores(
    a, sig, dp, vis, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT: tl.constexpr, REWEIGHT
):
    # P_ij and dL/ds_ij (docs/method.md section 5); LSSA / fallback rows: da = (dP - D) / W.
    prob, rpm1 = _probs(a, vis, mu, inv_xmax, has, winv, p, P_INT, REWEIGHT)
    cen = dp - d[:, None]
    if REWEIGHT:
        da = tl.where(has[:, None], coef[:, None] * rpm1 * cen - fn[:, None], cen * winv[:, None])
    else:
        da = cen * winv[:, None]
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
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, False,
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
            CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, False,
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
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, False,
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
            CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, False,
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
def _dkdv_loop(
    dk, dv, k, v, ik, Q, GO, ST, DF, IQ, M, SP, offs_n, b, hk, pid_n, m_lo, m_hi,
    sqb, sqh, sqt, sgb, sgh, sgt, smb, smh, smq, smk, H, G, Tq, Tk, off, plane, c0, p,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, KEY_MAJOR: tl.constexpr,
    WANT_DK: tl.constexpr, WANT_DV: tl.constexpr,
):  # fmt: skip
    # dk (BN, BD) and / or dv (BN, BDV) of one key block, summed in registers over the G query
    # heads of its GQA group and the query blocks [m_lo, m_hi) that can see it. dv alone needs
    # only S -> P -> P^T dO (no dO v^T, no score gradient); an accumulator not wanted is
    # returned as passed (the loops do not carry it). KEY_MAJOR: S and dP as k q^T, v dO^T
    # (M = BN in all four products).
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
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
            cq = _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM)
            has = xmax > 0
            inv_xmax = 1.0 / tl.where(has, xmax, 1.0)
            winv = 1.0 / tl.where(wtot > 0, wtot, 1.0)
            s, vis = _scores(
                q, k, cq, ik, offs_m, offs_n, _at(Mb, start_m, pid_n * BN, smq, smk),
                smq, smk, Tq, Tk, off, lo, hi, slo, shi,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, KEY_MAJOR,
            )  # fmt: skip
            if WANT_DK:
                d = tl.load(DF + rows, mask=rmask, other=0.0)
                f = tl.load(DF + plane + rows, mask=rmask, other=0.0)
                coef = p * winv * inv_xmax
                fn = tl.where(n > MIN_KEYS, f / tl.maximum(n, 1.0), 0.0)
                a, sig = _softplus_sigmoid(s)
                if KEY_MAJOR:
                    dp = tl.trans(_dot(v, tl.trans(go), IEEE, UPCAST))
                else:
                    dp = _dot(go, tl.trans(v), IEEE, UPCAST)
                prob, ds = _probs_dscores(
                    a, sig, dp, vis, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT, REWEIGHT
                )
                ds = ds * cq[:, None]
                if QK_NORM:
                    ds = ds * ik[None, :]
                if WANT_DV:
                    dv += _dot_lp(tl.trans(prob), go, IEEE, UPCAST, SPLIT)
                dk += _dot_lp(tl.trans(ds), q, IEEE, UPCAST, SPLIT)
            else:
                prob, _ = _probs(_softplus(s), vis, mu, inv_xmax, has, winv, p, P_INT, REWEIGHT)
                dv += _dot_lp(tl.trans(prob), go, IEEE, UPCAST, SPLIT)
    return dk, dv


@triton.jit
def _store_rows(P, rows, acc, rmask, D: tl.constexpr, BD: tl.constexpr):
    # acc (B, BD) into rows `rows` of a (., BD) fp32 plane: its first D columns
    offs = tl.arange(0, BD)
    tl.store(P + rows[:, None] * BD + offs[None, :], acc, mask=rmask[:, None] & (offs[None, :] < D))


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, GO, ST, DF, IQ, IK, M, SP, KR, DK, DVO,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, KEY_MAJOR: tl.constexpr, ONE_GRAD: tl.constexpr,
):  # fmt: skip
    # One key block of one kv head (_dkdv_loop: deterministic, no atomics). KEY_MAJOR and
    # ONE_GRAD (a config's choice: lssar.ops.triton.autotune) are the tiles for sm_90's wgmma,
    # which needs M % 64 == 0 per warpgroup: KEY_MAJOR takes S and dP as k q^T and v dO^T (M = BN
    # in all four products; query-major, two have M = BM); ONE_GRAD (not SPLIT, the hi + lo
    # products): two programs per key block, the even one computes dk and the odd one dv (the
    # host doubles the grid), so one fp32 accumulator is live, at the cost of S, softplus and the
    # weights computed by both.
    if ONE_GRAD:
        pid = tl.program_id(0)
        nblk = 2 * tl.cdiv(Tk, BN)
        pid_n = pid % nblk // 2
        role = pid % 2
        pid_bk = (pid // nblk).to(tl.int64)
    else:
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
    kv_rows = pid_bk * Tk + offs_n
    # the loop's runtime arguments (a tuple does not carry constexprs: those are passed below)
    loop = (
        k, v, ik, Q, GO, ST, DF, IQ, M, SP, offs_n, b, hk, pid_n, m_lo, m_hi,
        sqb, sqh, sqt, sgb, sgh, sgt, smb, smh, smq, smk, H, G, Tq, Tk, off, plane, c0, p,
    )  # fmt: skip
    if ONE_GRAD:
        if role == 0:
            dk, _ = _dkdv_loop(
                dk, dv, *loop, D, DV, BD, BDV, CAUSAL, HAS_MASK, LOG_N, QK_NORM, REWEIGHT,
                P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, BN, KEY_MAJOR, True, False,
            )  # fmt: skip
            _store_rows(DK, kv_rows, dk, kmask, D, BD)
        else:
            _, dv = _dkdv_loop(
                dk, dv, *loop, D, DV, BD, BDV, CAUSAL, HAS_MASK, LOG_N, QK_NORM, REWEIGHT,
                P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, BN, KEY_MAJOR, False, True,
            )  # fmt: skip
            _store_rows(DVO, kv_rows, dv, kmask, DV, BDV)
    else:
        dk, dv = _dkdv_loop(
            dk, dv, *loop, D, DV, BD, BDV, CAUSAL, HAS_MASK, LOG_N, QK_NORM, REWEIGHT,
            P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, BN, KEY_MAJOR, True, True,
        )  # fmt: skip
        _store_rows(DK, kv_rows, dk, kmask, D, BD)
        _store_rows(DVO, kv_rows, dv, kmask, DV, BDV)


# set when triton.jit returned interpreter functions (a module constant: torch.compile reads it)
INTERPRETED = not isinstance(fwd_kernel, triton.runtime.JITFunction)
