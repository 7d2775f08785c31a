"""Device code of ``impl="triton"``: the jitted kernels and the device functions they share.

Device code only. The autotuning (the configurations, the pruning ``fits`` with
``MEASURED_SPILLS``, the autotuning key, ``prune_configs_by`` and the
autotuned launchers ``fwd_tuned`` .. ``dkdv_tuned``) is :mod:`lssar.ops.triton.autotune`; the
host side (launch, custom ops, the public function) is :mod:`lssar.ops.triton.host`; the decode
kernel (split-K, reusing the device functions here) :mod:`lssar.ops.triton.decode`. The kernels
share the jitted device functions (the dot, softplus, the weight rule, the span bounds, the
tiles) that Triton resolves from this module's globals, so they stay one module.

FlashAttention-2-style kernels for the softplus-l1 family (lssa, lssar, softplus-l1; any ``p``).
The math is docs/method.md sections 3-5 and mirrors :mod:`lssar.ops.chunked` exactly (mean-centred
``x = softplus(s) - mu_i``, ``mu_i = Z_i / N_i`` for ``N_i > REWEIGHT_MIN_KEYS``,
``r = x / x_max``, LSSA weights for rows whose ``x`` are all within ``uniform_tolerance * mu_i``,
zeros for rows with ``N_i = 0``), in base 2: scores ``t = s log2 e`` (the row scale carries
``log2 e``) and weights ``softplus(s) / ln 2 = log2(1 + 2^t)``; ``ln 2`` cancels in every
normalisation, and ``d log2(1 + 2^t) / dt = sigmoid(s)``. Only the schedule differs:

forward (programs: query blocks x batch*heads on a 1-D grid; the ``T_q x T_k`` scores never exist)
    LSSA: one pass over the key blocks accumulating ``sum_j softplus(s_ij) v_j`` and ``Z_i``
    (Softplus needs no running max, so there is no rescaling as in softmax).
    LSSAR: pass 1 gives ``Z_i`` and ``m_i = max_j s_ij``; Softplus is monotone, so
    ``x_max = softplus(m_i) - mu_i`` (un-centred ``softplus(m_i)`` when
    ``N_i <= REWEIGHT_MIN_KEYS``); pass 2 accumulates ``r^p v`` and ``W_i = sum_j r^p`` with
    ``r in [0, 1]`` (no overflow), and with ``FOLD_F`` (a backward will follow) also
    ``U_i = sum_j r^(p-1) v_j`` and ``S_i = sum_j r^(p-1)``: ``F_i`` is then ``g_i . AUX_i`` with
    ``AUX_i = p / (W x_max) (U_i - S_i out_i)``, no pass over the keys. Per-row statistics
    ``(N, mu, x_max, W)`` (fp32, ``x_max = 0`` marks the LSSA fallback) are kept for the backward.
    Each pass walks the clean key blocks (every score visible, keys in range: no mask, no
    compare) and then the masked ones (the causal diagonal, the key tail; every block when a
    mask or key spans are given); a masked score is ``-inf``, whose weight, sigmoid and score
    gradient are all 0, so no visibility tile is kept.
backward
    rows kernel (per row, no key loop): ``D_i = g_i . out_i``, ``F_i = g_i . AUX_i`` and the row
    coefficients the others read; dk/dv kernel over query blocks (and the ``H_q / H_kv`` query
    heads of a GQA group) per key block (or per key block and gradient: ``ONE_GRAD``), adding
    each tile's dq into an fp32 buffer with atomics (``FUSED_DQ``, the default); with
    ``deterministic=True`` no atomics: the dq kernel over key blocks per query block instead.

key spans (``HAS_SPANS``; :mod:`lssar.ops.spans`: packed documents, sliding windows, sink tokens,
the causal rule folded in by the host)
    row ``i`` sees keys ``[lo_i, hi_i)`` and, with ``HAS_SINKS``, ``[slo_i, shi_i)`` (int32 planes
    from the host). A program over a block of rows (forward, both LSSAR passes; dq) loops
    only over the key blocks of the hulls of its rows' spans, the sinks' and the window's walked
    as one loop that skips the blocks between them (:func:`_span_blocks`); a dk/dv program only
    over the query blocks of the hull of its keys' row ranges (computed on the host, where no
    monotonicity of the bounds is assumed). Without spans (constexpr) none of it is compiled in.

``q . k`` is accumulated in fp32 from the raw inputs and scaled by fp32 inverse norms (host);
statistics and accumulators are fp32 for every input dtype; fp32 inputs use IEEE fp32 dots, or
TF32 tensor cores (``IEEE=False``) where torch allows TF32 (see the host). ``SPLIT`` feeds fp32
weights / score gradients to the tensor cores as a ``hi + lo`` pair in the input dtype (host,
``precise``). Softplus is ``max(t, 0) + log2(1 + 2^-|t|)``: one EX2 and a polynomial of degree
``POLY`` (by precision: :func:`lssar.ops.triton.host._poly`).

The compile check's cache is keyed by this source, line numbers included: host-side edits belong
in the autotune or host module. ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
imported (``triton.jit``, here and in ``triton.language``'s own helpers such as ``tl.zeros``,
picks compiled or interpreted code when a function is decorated); :data:`INTERPRETED` records
which it picked.
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
def _dot_pl(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr):
    # a in the input dtype times fp32 b (rounded to a's dtype; SPLIT: as _dot_lp's hi + lo)
    hi = b.to(a.dtype)
    res = _dot(a, hi, IEEE, UPCAST)
    if SPLIT:
        res += _dot(a, (b - hi.to(tl.float32)).to(a.dtype), IEEE, UPCAST)
    return res


@triton.jit
def _log2_1p_over(u, POLY: tl.constexpr):
    # log2(1 + u) / u on [0, 1], a polynomial of degree POLY (8 for fp32 inputs, 6 or 5 for half
    # precision: lssar.ops.triton.host) fitted for the least maximal relative error (Lawson's
    # iteration); errors of u * P(u) against float64 in fp32 Horner over u in [2^-40, 1]:
    # degree 8: 1.5e-7, 6: 1.4e-6, 5: 8.5e-6 (fits: 3.0e-8, 1.3e-6, 8.4e-6)
    if POLY == 8:
        c = 0.0075492286 * u - 0.042567346
        c = c * u + 0.11285685
        c = c * u - 0.19711973
        c = c * u + 0.2756419
        c = c * u - 0.35840863
        c = c * u + 0.48069298
        c = c * u - 0.72134024
        c = c * u + 1.442695
    elif POLY == 6:
        c = 0.02040137 * u - 0.095798425
        c = c * u + 0.21528599
        c = c * u - 0.3390901
        c = c * u + 0.47766876
        c = c * u - 0.7211595
        c = c * u + 1.4426932
    else:
        tl.static_assert(POLY == 5, "POLY: 8, 6 or 5")
        c = -0.034436397 * u + 0.14603472
        c = c * u - 0.3030385
        c = c * u + 0.46917528
        c = c * u - 0.72042644
        c = c * u + 1.442683
    return c


@triton.jit
def _softplus_parts(t, POLY: tl.constexpr):
    # Softplus in base 2 (ln 2 cancels in every l1 normalisation and in r = x / x_max):
    # softplus(s) / ln 2 = log2(1 + 2^t) = max(t, 0) + log2(1 + u), t = s log2(e) (the row scale
    # carries log2 e: _row_scale), u = 2^-|t| in (0, 1]: one MUFU.EX2 (ex2.approx.ftz; u flushes
    # to 0 below t = -126) and u P(u) (_log2_1p_over: POLY + 1 FMA-class instructions, no
    # MUFU: Triton 3.9 lowers tl.log2 to libdevice's __nv_log2f, ~20 instructions). Not
    # lg2.approx(1 + u): its error is ~2^-22 absolute near 1, a relative error of ~2^(t - 22) in
    # log2(1 + u) for t < 0 (12% at t = -19, where a row of large negative scores has all its
    # weights). w = 1 + u is for the sigmoid only (unused lanes are dead code).
    u = tl.exp2(-tl.abs(t))
    return tl.maximum(t, 0.0) + _log2_1p_over(u, POLY) * u, u, 1.0 + u


@triton.jit
def _softplus(t, POLY: tl.constexpr):
    sp, _, _ = _softplus_parts(t, POLY)
    return sp


@triton.jit
def _softplus_sigmoid(t, POLY: tl.constexpr):
    # (softplus(s) / ln 2, sigmoid(s)) of t = s log2(e): d log2(1 + 2^t) / dt = sigmoid(s)
    sp, u, w = _softplus_parts(t, POLY)
    return sp, tl.where(t >= 0, 1.0 / w, u / w)  # sigmoid from the same 2^-|t|


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
    if P_INT > 1:  # r^(p-1) is 0 at r = 0 already
        rpm1 = _ipow(r, P_INT - 1)
    else:
        pos = r > 0
        if P_INT == 1:
            rpm1 = tl.where(pos, 1.0, 0.0)
        else:
            rpm1 = tl.where(pos, tl.exp2((p - 1.0) * tl.log2(tl.where(pos, r, 1.0))), 0.0)
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
    MASKED: tl.constexpr,
):
    # s_ij = c_i * (q_i . k_j) / (|q_i| |k_j|), fp32 (BM, BN). MASKED: -inf where key j is not
    # visible to row i (spans: key j in the row's [lo, hi) or [slo, shi); they lie in [0, Tk),
    # and rows past Tq have empty ones, so no bounds test is needed then), so that every weight
    # and score gradient formed from it is 0 there (softplus(-inf) = 0, sigmoid(-inf) = 0, and
    # x = relu(0 - mu) = 0) with no separate visibility tile; a clean tile (not MASKED: every
    # score visible, keys in range) has no compare at all. KEY_MAJOR: the product taken as
    # k q^T (M = BN, the dk/dv kernel's tall side: sm_90's wgmma needs M % 64 == 0) and
    # transposed in registers.
    if KEY_MAJOR:
        s = tl.trans(_dot(k, tl.trans(q), IEEE, UPCAST)) * cq[:, None]
    else:
        s = _dot(q, tl.trans(k), IEEE, UPCAST) * cq[:, None]
    if QK_NORM:
        s = s * ik[None, :]
    if MASKED:
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
            # contiguous keys, so the mask tile can load as vectors (one address per vector, not
            # a 64-bit address and a predicate per score); measured on 192 masked
            # half-precision builds: up to 60 fewer registers, 4 spilling builds before and none
            # after
            allowed = tl.load(
                Mblk
                + tl.arange(0, q.shape[0])[:, None] * smq
                + tl.arange(0, k.shape[0])[None, :] * smk,
                mask=(offs_m[:, None] < Tq) & (offs_n[None, :] < Tk),
                other=0,
            )
            vis = vis & (allowed != 0)
        s = tl.where(vis, s, float("-inf"))
    return s


@triton.jit
def _ld(P, start, stride, offs_c, nmask, C: tl.constexpr, BC: tl.constexpr, B: tl.constexpr,
        MASKED: tl.constexpr):  # fmt: skip
    # a (B, BC) tile of rows start .. start + B - 1 of a plane, its first C columns (0 past
    # them); MASKED: rows where nmask is False read as 0. Unmasked, with C == BC: a plain load.
    ptr = _rows_at(P, start, stride, B) + offs_c[None, :]
    if MASKED:
        x = tl.load(ptr, mask=nmask[:, None] & (offs_c[None, :] < C), other=0.0)
    elif C == BC:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=offs_c[None, :] < C, other=0.0)
    return x


@triton.jit
def _ld_vec(P, offs, nmask, MASKED: tl.constexpr):
    # P[offs] (0 where nmask is False when MASKED; unmasked: every offset in range)
    if MASKED:
        x = tl.load(P + offs, mask=nmask, other=0.0)
    else:
        x = tl.load(P + offs)
    return x


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
    # c_i log2(e) (times 1/|q_i| when q is normalised in-kernel): the scores come out as
    # t = s log2(e), softplus's base-2 argument (_softplus_parts); c_i = ln(d) ln(N_i), or the
    # constant scale.
    if LOG_N:
        c = c0 * 1.4426950408889634 * tl.log(tl.maximum(n, 1.0))
    else:
        c = tl.zeros(n.shape, tl.float32) + c0 * 1.4426950408889634
    if QK_NORM:
        c = c * tl.load(IQr + rows, mask=rmask, other=0.0)
    return c


@triton.jit
def _probs(a, mu, inv_xmax, has, winv, p, P_INT: tl.constexpr, REWEIGHT: tl.constexpr):
    # P_ij (0 where a = softplus(-inf) = 0: not visible) and r^(p-1) (LSSAR; LSSA: a placeholder)
    if REWEIGHT:
        w, rpm1 = _sharpen(a, mu, inv_xmax, p, P_INT)
        w = tl.where(has[:, None], w, a)
    else:
        w = a
        rpm1 = a
    return w * winv[:, None], rpm1


@triton.jit
def _probs_dscores(
    a, sig, dp, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT: tl.constexpr, REWEIGHT
):
    # P_ij and dL/ds_ij (docs/method.md section 5); LSSA / fallback rows: da = (dP - D) / W. Not
    # visible: sig = sigmoid(-inf) = 0, so ds = 0 there (da is finite).
    prob, rpm1 = _probs(a, mu, inv_xmax, has, winv, p, P_INT, REWEIGHT)
    cen = dp - d[:, None]
    if REWEIGHT:
        da = tl.where(has[:, None], coef[:, None] * rpm1 * cen - fn[:, None], cen * winv[:, None])
    else:
        da = cen * winv[:, None]
    return prob, da * sig


@triton.jit
def _key_ranges(pid_m, Tk, off, lo, hi, slo, shi, BM: tl.constexpr, BN: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
                CLEAN: tl.constexpr):  # fmt: skip
    # The key blocks of a row block pid_m: clean ones [0, c_end) (CLEAN: no mask, no spans;
    # every score of the block visible to every row, keys in range), then the masked walk
    # `for it in range(k_lo, k_hi, BN)` at key offset _skip_gap(it, split, shift): the causal
    # diagonal and the key tail (all blocks without CLEAN; with spans, _span_blocks' walk).
    c_end = 0
    if HAS_SPANS:
        k_lo, k_hi, split, shift = _span_blocks(lo, hi, slo, shi, Tk, BN, HAS_SINKS)
    else:
        k_lo = 0
        k_hi = Tk
        if CAUSAL:  # the block's last row sees keys up to off + (pid_m + 1) * BM - 1
            k_hi = tl.minimum(Tk, off + (pid_m + 1) * BM)
        if CLEAN:
            c_end = Tk // BN * BN
            if CAUSAL:  # its first row sees keys up to off + pid_m * BM
                c_end = tl.minimum(tl.maximum(off + pid_m * BM + 1, 0) // BN * BN, c_end)
            k_lo = c_end
        split = k_hi
        shift = 0
    return c_end, k_lo, k_hi, split, shift


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _keys(Kb, IKb, start_n, skt, offs_d, Tk, D: tl.constexpr, BD: tl.constexpr,
          BN: tl.constexpr, QK_NORM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    # a key block: its offsets, k (BN, BD) and 1/|k| (QK_NORM; else a placeholder, not read)
    offs_n = start_n + tl.arange(0, BN)
    kmask = offs_n < Tk
    k = _ld(Kb, start_n, skt, offs_d, kmask, D, BD, BN, MASKED)
    if QK_NORM:
        ik = _ld_vec(IKb, offs_n, kmask, MASKED)
    else:
        ik = kmask
    return offs_n, k, ik


@triton.jit
def _row_tile_scores(
    start_n, q, cq, Kb, IKb, Mb, offs_m, offs_d, row0, skt, smq, smk, Tq, Tk, off,
    lo, hi, slo, shi,
    D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # a row program's key block at start_n: offsets, k, 1/|k| and the scores (-inf where not
    # visible: MASKED)
    offs_n, k, ik = _keys(Kb, IKb, start_n, skt, offs_d, Tk, D, BD, BN, QK_NORM, MASKED)
    s = _scores(
        q, k, cq, ik, offs_m, offs_n, _at(Mb, row0, start_n, smq, smk),
        smq, smk, Tq, Tk, off, lo, hi, slo, shi,
        CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, False, MASKED,
    )  # fmt: skip
    return offs_n, k, ik, s


@triton.jit
def _fwd_stats_tile(
    z, mx, start_n, ctx,
    D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr, POLY: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # LSSAR pass 1 over one key block: Z_i += sum_j softplus(s_ij), m_i = max(m_i, max_j s_ij)
    _, _, _, s = _row_tile_scores(
        start_n, *ctx, D, BD, BN, CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
        MASKED,
    )  # fmt: skip
    return z + tl.sum(_softplus(s, POLY), 1), tl.maximum(mx, tl.max(s, 1))


@triton.jit
def _fwd_out_tile(
    acc, wsum, uacc, s2, start_n, ctx, Vb, svt, offs_dv, Tk, mu, inv_xmax, has, p,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr, POLY: tl.constexpr,
    FOLD_F: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # the output pass over one key block: acc += w V, W_i += sum_j w_ij (w = 0 where not
    # visible); FOLD_F (LSSAR with a backward to follow) also U += r^(p-1) V and
    # S_i += sum_j r^(p-1), which give the backward's F_i with no pass over the keys
    offs_n, _, _, s = _row_tile_scores(
        start_n, *ctx, D, BD, BN, CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
        MASKED,
    )  # fmt: skip
    w = _softplus(s, POLY)
    v = _ld(Vb, start_n, svt, offs_dv, offs_n < Tk, DV, BDV, BN, MASKED)
    if REWEIGHT:
        r, rpm1 = _sharpen(w, mu, inv_xmax, p, P_INT)
        w = tl.where(has[:, None], r, w)
        if FOLD_F:
            uacc += _dot_lp(rpm1, v, IEEE, UPCAST, SPLIT)
            s2 += tl.sum(rpm1, 1)
    return acc + _dot_lp(w, v, IEEE, UPCAST, SPLIT), wsum + tl.sum(w, 1), uacc, s2


@triton.jit
def fwd_kernel(
    Q, K, V, O, ST, AUX, IQ, IK, M, SP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr, POLY: tl.constexpr,
    FOLD_F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # Each pass: the clean key blocks (no mask, no compare), then the masked ones (the causal
    # diagonal, the key tail; every block with a mask or spans). FOLD_F: LSSAR with a backward
    # to follow (AUX; an inference forward skips the extra product and accumulator).
    pid_m, pid_bh = _program(Tq, BM)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    q = _ld(Q + b * sqb + h * sqh, pid_m * BM, sqt, offs_d, rmask, D, BD, BM, True)
    n = tl.load(ST + rows, mask=rmask, other=0.0)
    cq = _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM)
    Vb = V + b * svb + hk * svh
    lo, hi, slo, shi = _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS, HAS_SINKS)
    c_end, k_lo, k_hi, split, shift = _key_ranges(
        pid_m, Tk, off, lo, hi, slo, shi, BM, BN, CAUSAL, HAS_SPANS, HAS_SINKS,
        not HAS_MASK and not HAS_SPANS,
    )  # fmt: skip
    # the runtime arguments of a key block's scores (a tuple does not carry constexprs)
    ctx = (
        q, cq, K + b * skb + hk * skh, IK + (b * (H // G) + hk) * Tk, M + b * smb + h * smh,
        offs_m, offs_d, pid_m * BM, skt, smq, smk, Tq, Tk, off, lo, hi, slo, shi,
    )  # fmt: skip

    mu = tl.zeros((BM,), tl.float32)
    xmax = tl.zeros((BM,), tl.float32)
    if REWEIGHT:
        z = tl.zeros((BM,), tl.float32)
        mx = tl.full((BM,), float("-inf"), tl.float32)
        for start_n in range(0, c_end, BN):
            z, mx = _fwd_stats_tile(
                z, mx, start_n, ctx, D, BD, BN,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, POLY, False,
            )  # fmt: skip
        for it in range(k_lo, k_hi, BN):
            start_n = _skip_gap(it, split, shift, HAS_SINKS)
            z, mx = _fwd_stats_tile(
                z, mx, start_n, ctx, D, BD, BN,
                CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, POLY, True,
            )  # fmt: skip
        mu = tl.where(n > MIN_KEYS, z / tl.maximum(n, 1.0), 0.0)
        # softplus is monotone: the row's largest x is softplus(max s) - mu (0 for empty rows);
        # deviations within tol * mu of the mean are rounding noise: a uniform row, LSSA weights
        xmax = tl.maximum(_softplus(mx, POLY) - mu, 0.0)
        xmax = tl.where(xmax > tol * mu, xmax, 0.0)
    has = xmax > 0
    inv_xmax = 1.0 / tl.where(has, xmax, 1.0)

    acc = tl.zeros((BM, BDV), tl.float32)
    wsum = tl.zeros((BM,), tl.float32)
    if FOLD_F:
        uacc = tl.zeros((BM, BDV), tl.float32)
    else:
        uacc = tl.zeros((1, 1), tl.float32)  # not carried: no F_i to fold
    s2 = tl.zeros((BM,), tl.float32)
    row = (Vb, svt, offs_dv, Tk, mu, inv_xmax, has, p)
    for start_n in range(0, c_end, BN):
        acc, wsum, uacc, s2 = _fwd_out_tile(
            acc, wsum, uacc, s2, start_n, ctx, *row, D, DV, BD, BDV, BN, CAUSAL, HAS_MASK,
            QK_NORM, REWEIGHT, P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, POLY, FOLD_F,
            False,
        )  # fmt: skip
    for it in range(k_lo, k_hi, BN):
        start_n = _skip_gap(it, split, shift, HAS_SINKS)
        acc, wsum, uacc, s2 = _fwd_out_tile(
            acc, wsum, uacc, s2, start_n, ctx, *row, D, DV, BD, BDV, BN, CAUSAL, HAS_MASK,
            QK_NORM, REWEIGHT, P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, POLY, FOLD_F,
            True,
        )  # fmt: skip
    winv = 1.0 / tl.where(wsum > 0, wsum, 1.0)
    out = acc * winv[:, None]
    tl.store(
        _rows_at(O + b * sob + h * soh, pid_m * BM, sot, BM) + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=rmask[:, None] & (offs_dv[None, :] < DV),
    )
    if FOLD_F:
        # F_i = sum_j dx_ij = p / (W x_max) sum_j r^(p-1) (dP_ij - D_i) = g_i . AUX_i with
        # AUX_i = p / (W x_max) (U_i - S_i out_i) (0 for LSSA-fallback rows), and the fp32
        # output for an exact D_i = g_i . out_i (the stored one is rounded: its D_i, amplified
        # by p r^(p-1) / (W x_max), took bf16 gradients past the accuracy rule): fp32
        # (B,H,Tq,2,BDV)
        coef = tl.where(has, p * winv * inv_xmax, 0.0)
        _store_rows(AUX, 2 * rows, (uacc - s2[:, None] * out) * coef[:, None], rmask, DV, BDV)
        _store_rows(AUX, 2 * rows + 1, out, rmask, DV, BDV)
    tl.store(ST + plane + rows, mu, mask=rmask)
    tl.store(ST + 2 * plane + rows, xmax, mask=rmask)
    tl.store(ST + 3 * plane + rows, wsum, mask=rmask)


# the per-row planes of the backward (bwd_rows_kernel -> bwd_dq_kernel, bwd_dkdv_kernel), each
# (B, H, Tq) fp32 in one (RC_PLANES, B, H, Tq) buffer
RC_CQ, RC_WINV, RC_D, RC_MU, RC_INV_XMAX, RC_COEF, RC_FN = (tl.constexpr(i) for i in range(7))
RC_PLANES = 7


@triton.jit
def bwd_rows_kernel(
    O, GO, ST, AUX, RC, IQ,
    sob, soh, sot, sgb, sgh, sgt,
    H, Tq, plane, c0, p,
    DV: tl.constexpr, BDV: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    # Per row, no pass over the keys: D_i = g_i . out_i (LSSAR: the fp32 output of AUX),
    # F_i = g_i . AUX_i (LSSAR: fwd_kernel's p / (W x_max) (U_i - S_i out_i)) and the row
    # coefficients the dq and dk/dv kernels read
    # (RC_*): c_i (times 1/|q_i|), 1/W_i, D_i, mu_i, 1/x_max (0 for LSSA-fallback rows),
    # p / (W_i x_max) and the mean-centring term F_i / N_i (N_i > 3, else 0).
    pid_m, pid_bh = _program(Tq, BM)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    go = _ld(GO + b * sgb + h * sgh, pid_m * BM, sgt, offs_dv, rmask, DV, BDV, BM, True)
    go = go.to(tl.float32)
    if REWEIGHT:
        aux = AUX + (2 * rows[:, None]) * BDV + offs_dv[None, :]
        o = tl.load(aux + BDV, mask=rmask[:, None], other=0.0)
    else:
        o = _ld(O + b * sob + h * soh, pid_m * BM, sot, offs_dv, rmask, DV, BDV, BM, True)
    n = tl.load(ST + rows, mask=rmask, other=0.0)
    wtot = tl.load(ST + 3 * plane + rows, mask=rmask, other=0.0)
    winv = 1.0 / tl.where(wtot > 0, wtot, 1.0)
    tl.store(RC + RC_CQ * plane + rows, _row_scale(n, c0, IQ, rows, rmask, LOG_N, QK_NORM), rmask)
    tl.store(RC + RC_WINV * plane + rows, winv, mask=rmask)
    tl.store(RC + RC_D * plane + rows, tl.sum(go * o.to(tl.float32), 1), mask=rmask)
    if REWEIGHT:
        xmax = tl.load(ST + 2 * plane + rows, mask=rmask, other=0.0)
        inv_xmax = tl.where(xmax > 0, 1.0 / tl.where(xmax > 0, xmax, 1.0), 0.0)
        f = tl.sum(go * tl.load(aux, mask=rmask[:, None], other=0.0), 1)
        fn = tl.where(n > MIN_KEYS, f / tl.maximum(n, 1.0), 0.0)
        tl.store(RC + RC_MU * plane + rows, tl.load(ST + plane + rows, mask=rmask), mask=rmask)
        tl.store(RC + RC_INV_XMAX * plane + rows, inv_xmax, mask=rmask)
        tl.store(RC + RC_COEF * plane + rows, p * winv * inv_xmax, mask=rmask)
        tl.store(RC + RC_FN * plane + rows, fn, mask=rmask)


@triton.jit
def _rc_rows(RC, rows, rmask, plane, REWEIGHT: tl.constexpr, MASKED: tl.constexpr):
    # the row coefficients of bwd_rows_kernel: (cq, winv, d, mu, inv_xmax, has, coef, fn); LSSA:
    # the last five are placeholders (not read)
    cq = _ld_vec(RC + RC_CQ * plane, rows, rmask, MASKED)
    winv = _ld_vec(RC + RC_WINV * plane, rows, rmask, MASKED)
    d = _ld_vec(RC + RC_D * plane, rows, rmask, MASKED)
    if REWEIGHT:
        mu = _ld_vec(RC + RC_MU * plane, rows, rmask, MASKED)
        inv_xmax = _ld_vec(RC + RC_INV_XMAX * plane, rows, rmask, MASKED)
        coef = _ld_vec(RC + RC_COEF * plane, rows, rmask, MASKED)
        fn = _ld_vec(RC + RC_FN * plane, rows, rmask, MASKED)
    else:
        mu = d
        inv_xmax = d
        coef = d
        fn = d
    return cq, winv, d, mu, inv_xmax, inv_xmax > 0, coef, fn


@triton.jit
def _dq_tile(
    dq, start_n, ctx, Vb, svt, offs_dv, Tk, go, winv, d, mu, inv_xmax, has, coef, fn, p,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr, POLY: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    # one key block of dq: dS K with dS scaled by c_i / (|q_i| |k_j|)
    offs_n, k, ik, s = _row_tile_scores(
        start_n, *ctx, D, BD, BN, CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS,
        MASKED,
    )  # fmt: skip
    a, sig = _softplus_sigmoid(s, POLY)
    v = _ld(Vb, start_n, svt, offs_dv, offs_n < Tk, DV, BDV, BN, MASKED)
    dp = _dot(go, tl.trans(v), IEEE, UPCAST)
    _, ds = _probs_dscores(a, sig, dp, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT, REWEIGHT)
    ds = ds * ctx[1][:, None]
    if QK_NORM:
        ds = ds * ik[None, :]
    return dq + _dot_lp(ds, k, IEEE, UPCAST, SPLIT)


@triton.jit
def bwd_dq_kernel(
    Q, K, V, GO, RC, IK, M, SP, DQ,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, p, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr, POLY: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # dq_fix_i = sum_j ds_ij c_i / (|q_i| |k_j|) k_j (gradient at fixed norms), fp32 (B,H,Tq,BD):
    # the deterministic dq (the dk/dv kernel's FUSED_DQ adds it with atomics instead)
    pid_m, pid_bh = _program(Tq, BM)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    rows = pid_bh * Tq + offs_m
    q = _ld(Q + b * sqb + h * sqh, pid_m * BM, sqt, offs_d, rmask, D, BD, BM, True)
    go = _ld(GO + b * sgb + h * sgh, pid_m * BM, sgt, offs_dv, rmask, DV, BDV, BM, True)
    cq, winv, d, mu, inv_xmax, has, coef, fn = _rc_rows(RC, rows, rmask, plane, REWEIGHT, True)
    lo, hi, slo, shi = _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS, HAS_SINKS)
    c_end, k_lo, k_hi, split, shift = _key_ranges(
        pid_m, Tk, off, lo, hi, slo, shi, BM, BN, CAUSAL, HAS_SPANS, HAS_SINKS,
        not HAS_MASK and not HAS_SPANS,
    )  # fmt: skip
    ctx = (
        q, cq, K + b * skb + hk * skh, IK + (b * (H // G) + hk) * Tk, M + b * smb + h * smh,
        offs_m, offs_d, pid_m * BM, skt, smq, smk, Tq, Tk, off, lo, hi, slo, shi,
    )  # fmt: skip
    row = (V + b * svb + hk * svh, svt, offs_dv, Tk, go, winv, d, mu, inv_xmax, has, coef, fn, p)
    dq = tl.zeros((BM, BD), tl.float32)
    for start_n in range(0, c_end, BN):
        dq = _dq_tile(
            dq, start_n, ctx, *row, D, DV, BD, BDV, BN, CAUSAL, HAS_MASK, QK_NORM, REWEIGHT,
            P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, POLY, False,
        )  # fmt: skip
    for it in range(k_lo, k_hi, BN):
        start_n = _skip_gap(it, split, shift, HAS_SINKS)
        dq = _dq_tile(
            dq, start_n, ctx, *row, D, DV, BD, BDV, BN, CAUSAL, HAS_MASK, QK_NORM, REWEIGHT,
            P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, POLY, True,
        )  # fmt: skip
    _store_rows(DQ, rows, dq, rmask, D, BD)


@triton.jit
def _dkdv_tile(
    dk, dv, start_m, k, v, ik, Qb, GOb, Mb, RC, SP, DQ, offs_n, bh, n0,
    sqt, sgt, smq, smk, Tq, Tk, off, plane, p,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, KEY_MAJOR: tl.constexpr, WANT_DK: tl.constexpr, WANT_DV: tl.constexpr,
    FUSED_DQ: tl.constexpr, POLY: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # the query block at start_m of one head's contribution to a key block's dk (BN, BD) and / or
    # dv (BN, BDV), and with FUSED_DQ its dq (BM, BD), added to DQ with fp32 atomics. dv alone
    # needs only S -> P -> P^T dO (no dO v^T, no score gradient); an accumulator not wanted is
    # returned as passed. KEY_MAJOR: S and dP as k q^T, v dO^T (M = BN in all four products).
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = offs_m < Tq
    lo, hi, slo, shi = _span_rows(SP, offs_m, rmask, Tq, HAS_SPANS, HAS_SINKS)
    rows = bh * Tq + offs_m
    q = _ld(Qb, start_m, sqt, offs_d, rmask, D, BD, BM, MASKED)
    go = _ld(GOb, start_m, sgt, offs_dv, rmask, DV, BDV, BM, MASKED)
    cq, winv, d, mu, inv_xmax, has, coef, fn = _rc_rows(RC, rows, rmask, plane, REWEIGHT, MASKED)
    s = _scores(
        q, k, cq, ik, offs_m, offs_n, _at(Mb, start_m, n0, smq, smk),
        smq, smk, Tq, Tk, off, lo, hi, slo, shi,
        CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, HAS_SPANS, HAS_SINKS, KEY_MAJOR, MASKED,
    )  # fmt: skip
    if WANT_DK:
        a, sig = _softplus_sigmoid(s, POLY)
        if KEY_MAJOR:
            dp = tl.trans(_dot(v, tl.trans(go), IEEE, UPCAST))
        else:
            dp = _dot(go, tl.trans(v), IEEE, UPCAST)
        prob, ds = _probs_dscores(
            a, sig, dp, mu, inv_xmax, has, coef, fn, d, winv, p, P_INT, REWEIGHT
        )
        ds = ds * cq[:, None]
        if QK_NORM:
            ds = ds * ik[None, :]
        if WANT_DV:
            dv += _dot_lp(tl.trans(prob), go, IEEE, UPCAST, SPLIT)
        dk += _dot_lp(tl.trans(ds), q, IEEE, UPCAST, SPLIT)
        if FUSED_DQ:
            if KEY_MAJOR:  # as k^T dS^T (M = BD, wgmma's tall side), transposed in registers
                dq = tl.trans(_dot_pl(tl.trans(k), tl.trans(ds), IEEE, UPCAST, SPLIT))
            else:
                dq = _dot_lp(ds, k, IEEE, UPCAST, SPLIT)
            ptr = DQ + rows[:, None] * BD + offs_d[None, :]
            if MASKED:
                tl.atomic_add(ptr, dq, mask=rmask[:, None] & (offs_d[None, :] < D), sem="relaxed")
            elif D == BD:
                tl.atomic_add(ptr, dq, sem="relaxed")
            else:
                tl.atomic_add(ptr, dq, mask=offs_d[None, :] < D, sem="relaxed")
    else:
        prob, _ = _probs(_softplus(s, POLY), mu, inv_xmax, has, winv, p, P_INT, REWEIGHT)
        dv += _dot_lp(tl.trans(prob), go, IEEE, UPCAST, SPLIT)
    return dk, dv


@triton.jit
def _query_ranges(n0, Tq, Tk, off, KR, offs_n, kmask, BM: tl.constexpr, BN: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_SPANS: tl.constexpr, CLEAN: tl.constexpr):  # fmt: skip
    # The query blocks a key block [n0, n0 + BN) is seen by: clean ones [c_lo, c_hi) (CLEAN: no
    # mask, no spans; every row of the block sees every key, rows and keys in range), and the
    # masked walk `for it in range(m_lo, m_end, BM)` at row offset it + (c_hi - c_lo) once
    # it >= c_lo: [m_lo, c_lo) (the causal diagonal) then [c_hi, m_hi) (the row tail).
    m_lo = 0
    m_hi = Tq
    if CAUSAL:  # query i sees key j iff j <= off + i: rows before n0 - off cannot see this block
        m_lo = (tl.maximum(n0 - off, 0) // BM) * BM
    if HAS_SPANS:  # only the row blocks whose spans may reach this key block
        m_lo, m_hi = _span_query_rows(KR, offs_n, kmask, Tq, Tk, BM)
    c_lo = m_lo
    c_hi = m_lo
    if CLEAN:
        c_hi = Tq // BM * BM
        if n0 + BN > Tk:  # a key tail: every block masked
            c_hi = m_lo
        if CAUSAL:  # rows from n0 + BN - 1 - off on see the whole key block
            c_lo = tl.maximum(tl.cdiv(tl.maximum(n0 + BN - 1 - off, 0), BM) * BM, m_lo)
        c_lo = tl.minimum(c_lo, c_hi)
    return m_lo, m_lo + (c_lo - m_lo) + tl.maximum(m_hi - c_hi, 0), c_lo, c_hi


@triton.jit
def _dkdv_loop(
    dk, dv, k, v, ik, Q, GO, RC, M, SP, KR, DQ, offs_n, kmask, b, hk, pid_n,
    sqb, sqh, sqt, sgb, sgh, sgt, smb, smh, smq, smk, H, G, Tq, Tk, off, plane, p,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, KEY_MAJOR: tl.constexpr,
    WANT_DK: tl.constexpr, WANT_DV: tl.constexpr, FUSED_DQ: tl.constexpr, POLY: tl.constexpr,
):  # fmt: skip
    # dk / dv of one key block, summed in registers over the G query heads of its GQA group and
    # the query blocks that can see it: the clean blocks, then the masked ones.
    n0 = pid_n * BN
    m_lo, m_end, c_lo, c_hi = _query_ranges(
        n0, Tq, Tk, off, KR, offs_n, kmask, BM, BN, CAUSAL, HAS_SPANS,
        not HAS_MASK and not HAS_SPANS,
    )  # fmt: skip
    for g in range(G):
        h = hk * G + g
        ctx = (
            k, v, ik, Q + b * sqb + h * sqh, GO + b * sgb + h * sgh, M + b * smb + h * smh,
            RC, SP, DQ, offs_n, b * H + h, n0, sqt, sgt, smq, smk, Tq, Tk, off, plane, p,
        )  # fmt: skip
        for start_m in range(c_lo, c_hi, BM):
            dk, dv = _dkdv_tile(
                dk, dv, start_m, *ctx, D, DV, BD, BDV, CAUSAL, HAS_MASK, QK_NORM,
                REWEIGHT, P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, KEY_MAJOR,
                WANT_DK, WANT_DV, FUSED_DQ, POLY, False,
            )  # fmt: skip
        for it in range(m_lo, m_end, BM):
            start_m = it + tl.where(it >= c_lo, c_hi - c_lo, 0)
            dk, dv = _dkdv_tile(
                dk, dv, start_m, *ctx, D, DV, BD, BDV, CAUSAL, HAS_MASK, QK_NORM,
                REWEIGHT, P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, KEY_MAJOR,
                WANT_DK, WANT_DV, FUSED_DQ, POLY, True,
            )  # fmt: skip
    return dk, dv


@triton.jit
def _store_rows(P, rows, acc, rmask, D: tl.constexpr, BD: tl.constexpr):
    # acc (B, BD) into rows `rows` of a (., BD) fp32 plane: its first D columns
    offs = tl.arange(0, BD)
    tl.store(P + rows[:, None] * BD + offs[None, :], acc, mask=rmask[:, None] & (offs[None, :] < D))


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, GO, RC, IK, M, SP, KR, DK, DVO, DQ,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, p, tq_key, tk_key,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SPANS: tl.constexpr, HAS_SINKS: tl.constexpr, POLY: tl.constexpr,
    FUSED_DQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KEY_MAJOR: tl.constexpr,
    ONE_GRAD: tl.constexpr,
):  # fmt: skip
    # One key block of one kv head (_dkdv_loop; FUSED_DQ: also the query blocks' dq, added to DQ
    # with fp32 atomics, so no dq kernel runs: the non-deterministic backward). KEY_MAJOR and
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
    k = _ld(K + b * skb + hk * skh, pid_n * BN, skt, offs_d, kmask, D, BD, BN, True)
    v = _ld(V + b * svb + hk * svh, pid_n * BN, svt, offs_dv, kmask, DV, BDV, BN, True)
    if QK_NORM:
        ik = tl.load(IK + pid_bk * Tk + offs_n, mask=kmask, other=0.0)
    else:
        ik = kmask
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BDV), tl.float32)
    kv_rows = pid_bk * Tk + offs_n
    # the loop's runtime arguments (a tuple does not carry constexprs: those are passed below)
    loop = (
        k, v, ik, Q, GO, RC, M, SP, KR, DQ, offs_n, kmask, b, hk, pid_n,
        sqb, sqh, sqt, sgb, sgh, sgt, smb, smh, smq, smk, H, G, Tq, Tk, off, plane, p,
    )  # fmt: skip
    if ONE_GRAD:
        if role == 0:
            dk, _ = _dkdv_loop(
                dk, dv, *loop, D, DV, BD, BDV, CAUSAL, HAS_MASK, QK_NORM, REWEIGHT,
                P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, BN, KEY_MAJOR, True, False,
                FUSED_DQ, POLY,
            )  # fmt: skip
            _store_rows(DK, kv_rows, dk, kmask, D, BD)
        else:
            _, dv = _dkdv_loop(
                dk, dv, *loop, D, DV, BD, BDV, CAUSAL, HAS_MASK, QK_NORM, REWEIGHT,
                P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, BN, KEY_MAJOR, False, True,
                False, POLY,
            )  # fmt: skip
            _store_rows(DVO, kv_rows, dv, kmask, DV, BDV)
    else:
        dk, dv = _dkdv_loop(
            dk, dv, *loop, D, DV, BD, BDV, CAUSAL, HAS_MASK, QK_NORM, REWEIGHT,
            P_INT, IEEE, UPCAST, SPLIT, HAS_SPANS, HAS_SINKS, BM, BN, KEY_MAJOR, True, True,
            FUSED_DQ, POLY,
        )  # fmt: skip
        _store_rows(DK, kv_rows, dk, kmask, D, BD)
        _store_rows(DVO, kv_rows, dv, kmask, DV, BDV)


# set when triton.jit returned interpreter functions (a module constant: torch.compile reads it)
INTERPRETED = not isinstance(fwd_kernel, triton.runtime.JITFunction)
