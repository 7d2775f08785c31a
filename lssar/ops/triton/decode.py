"""Decode steps of ``impl="triton"``: split-K kernels (FlashDecoding) with the GQA heads as rows.

A decode step (a few new queries, no gradient to record) has too few query rows for the prefill
kernels' one program per row block and head: at batch 1 they start ``H`` programs, a few percent
of a GPU's SMs, each walking the whole cache. Here one program takes one slice of the cache
(``span`` keys, a multiple of the largest key block) for all the query rows that read one kv
head: the ``G = H_q / H_kv`` heads of its GQA group times ``T_q`` queries, packed as the rows of
one tile (``BM = G T_q`` rounded up to a power of two, at least 16, at most
:data:`MAX_ROWS`), so K and V are read once per kv head and the slices fill the GPU
(:func:`splits`). Per slice the kernel writes partial sums; the host adds them up:

- LSSA, one launch: ``sum_j softplus(s_ij) v_j`` and ``W_i`` per slice; ``out = sum / sum W``
  (Softplus needs no running maximum, so the partials add without rescaling).
- LSSAR, two launches: pass 1 (``PASS=1``) writes each slice's ``Z_i`` and ``max_j s_ij`` and the
  scores themselves (fp32, ``4 G T_q`` bytes per key and kv head: less than re-reading the keys,
  ``2 D`` bytes, for ``G T_q < D / 2``); pass 2 combines the slices' statistics (every program
  for its rows: ``mu_i``, ``x_max``), reads the scores back instead of K, and writes the partial
  ``sum r^p v`` and ``W_i``.

Same math and conventions as :mod:`lssar.ops.triton.kernels` (base-2 scores, the visibility
rules: bottom-right causal, a boolean mask broadcast to ``[B, H, T_q, T_k]``); no key spans
(documents, windows, sinks) and no gradient: :func:`applies` says when the host takes this path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lssar.ops.triton.autotune import MAXNREG
from lssar.ops.triton.kernels import (
    MIN_KEYS,
    _dot,
    _dot_lp,
    _ld,
    _ld_vec,
    _row_scale,
    _sharpen,
    _softplus,
)

MAX_ROWS = 64  # packed query rows (G T_q) per program: q and the accumulator stay in registers
MAX_BN = 128  # the largest key block of the configs: slices are multiples of it
# the largest packed rows x padded head dim per program: q in registers and the fp32
# accumulator of a 64 x 128 (or 32 x 256) tile (compile_check's decode cases)
MAX_ROW_ELEMENTS = 64 * 128


@triton.jit
def _decode_scores(q, k, cq, ik, t_row, rvalid, mrow, offs_n, smk, Tk, off,
                   CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    # t_ij = c_i log2(e) cos(q_i, k_j) of the packed rows (BM, BN); MASKED: -inf where key j is
    # not visible to row i (row padding, key tail, causal rule at query t_row, the mask row)
    s = _dot(q, tl.trans(k), IEEE, UPCAST) * cq[:, None]
    if QK_NORM:
        s = s * ik[None, :]
    if MASKED:
        vis = rvalid[:, None] & (offs_n[None, :] < Tk)
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= t_row[:, None] + off)
        if HAS_MASK:
            allowed = tl.load(
                mrow[:, None] + offs_n[None, :].to(tl.int64) * smk,
                mask=rvalid[:, None] & (offs_n[None, :] < Tk),
                other=0,
            )
            vis = vis & (allowed != 0)
        s = tl.where(vis, s, float("-inf"))
    return s


@triton.jit
def _decode_tile(
    acc, wsum, z, mx, start_n, q, cq, t_row, rvalid, mrow, Kb, Vb, IKb, SCb, offs_d, offs_dv,
    skt, svt, smk, Tk, off, mu, inv_xmax, has, p,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, POLY: tl.constexpr, PASS: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # one key block of a slice: PASS 1 (LSSAR) Z, max and the scores to SCb; PASS 2 the
    # weighted values (LSSAR: scores read back from SCb, no K)
    offs_n = start_n + tl.arange(0, BN)
    kmask = offs_n < Tk
    sc_ptr = SCb + offs_n[None, :]
    sc_mask = rvalid[:, None] & kmask[None, :]  # only the real rows' scores are kept
    if REWEIGHT and PASS == 2:
        s = tl.load(sc_ptr, mask=sc_mask, other=float("-inf"))
    else:
        k = _ld(Kb, start_n, skt, offs_d, kmask, D, BD, BN, MASKED)
        if QK_NORM:
            ik = _ld_vec(IKb, offs_n, kmask, MASKED)
        else:
            ik = kmask
        s = _decode_scores(
            q, k, cq, ik, t_row, rvalid, mrow, offs_n, smk, Tk, off,
            CAUSAL, HAS_MASK, QK_NORM, IEEE, UPCAST, MASKED,
        )  # fmt: skip
    a = _softplus(s, POLY)
    if PASS == 1:
        tl.store(sc_ptr, s, mask=sc_mask)
        z += tl.sum(a, 1)
        mx = tl.maximum(mx, tl.max(s, 1))
    else:
        if REWEIGHT:
            r, _ = _sharpen(a, mu, inv_xmax, p, P_INT)
            a = tl.where(has[:, None], r, a)
        v = _ld(Vb, start_n, svt, offs_dv, kmask, DV, BDV, BN, MASKED)
        acc += _dot_lp(a, v, IEEE, UPCAST, SPLIT)
        wsum += tl.sum(a, 1)
    return acc, wsum, z, mx


@triton.jit
def decode_kernel(
    Q, K, V, ST, IQ, IK, M, SC, PACC, PROW,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, smb, smh, smq, smk,
    H, G, Tq, Tk, off, plane, c0, p, tol, nsplit, span, bhk,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, LOG_N: tl.constexpr, QK_NORM: tl.constexpr,
    REWEIGHT: tl.constexpr, P_INT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, POLY: tl.constexpr, PASS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # One slice [split * span, (split + 1) * span) of one kv head's cache for its G * Tq packed
    # rows (row r: query head hk * G + r // Tq, query r % Tq); bhk = B * HK. Partials: PACC
    # (nsplit, bhk, BM, BDV) fp32 sum_j w_ij v_j; PROW (3, nsplit, bhk, BM) fp32 Z_i,
    # max_j t_ij (PASS 1), W_i (PASS 2); SC (bhk, G * Tq, Tk) fp32 the LSSAR scores between the
    # passes.
    pid = tl.program_id(0)
    split = pid % nsplit
    bk = (pid // nsplit).to(tl.int64)
    HK = H // G
    b = bk // HK
    hk = bk % HK
    r = tl.arange(0, BM)
    g = r // Tq
    t_row = r % Tq
    rvalid = r < G * Tq
    h = hk * G + tl.where(rvalid, g, 0)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    qrow = Q + b * sqb + h.to(tl.int64) * sqh + t_row * sqt
    q = tl.load(qrow[:, None] + offs_d[None, :], mask=rvalid[:, None] & (offs_d[None, :] < D))
    rows = (b * H + h) * Tq + t_row  # in the (B, H, Tq) planes of N and 1/|q|
    n = tl.load(ST + rows, mask=rvalid, other=0.0)
    cq = _row_scale(n, c0, IQ, rows, rvalid, LOG_N, QK_NORM)
    mrow = M + b * smb + h.to(tl.int64) * smh + t_row * smq
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    IKb = IK + bk * Tk
    SCb = SC + (bk * (G * Tq) + r[:, None]) * Tk  # rows past G * Tq: never read or written
    k0 = split * span
    k1 = tl.minimum(Tk, k0 + span)
    # clean blocks: in range, and (causal) visible to every row: the earliest query sees keys
    # up to off; with a mask every block is masked
    c_end = k0
    if not HAS_MASK:
        c_end = tl.minimum(k1, Tk // BN * BN)
        if CAUSAL:
            c_end = tl.minimum(c_end, tl.maximum(off + 1, 0) // BN * BN)
        c_end = tl.maximum(c_end, k0)
    slot = (split * bhk + bk) * BM + r  # this program's rows in a PROW plane
    psize = nsplit * bhk * BM  # one PROW plane
    mu = tl.zeros((BM,), tl.float32)
    inv_xmax = tl.zeros((BM,), tl.float32)
    has = mu > 0
    if REWEIGHT and PASS == 2:  # the row statistics from every slice's pass 1
        z = tl.zeros((BM,), tl.float32)
        mx = tl.full((BM,), float("-inf"), tl.float32)
        for s in range(nsplit):
            other = (s * bhk + bk) * BM + r
            z += tl.load(PROW + other)
            mx = tl.maximum(mx, tl.load(PROW + psize + other))
        mu = tl.where(n > MIN_KEYS, z / tl.maximum(n, 1.0), 0.0)
        xmax = tl.maximum(_softplus(mx, POLY) - mu, 0.0)
        xmax = tl.where(xmax > tol * mu, xmax, 0.0)
        has = xmax > 0
        inv_xmax = 1.0 / tl.where(has, xmax, 1.0)
    acc = tl.zeros((BM, BDV), tl.float32)
    wsum = tl.zeros((BM,), tl.float32)
    z = tl.zeros((BM,), tl.float32)
    mx = tl.full((BM,), float("-inf"), tl.float32)
    ctx = (q, cq, t_row, rvalid, mrow, Kb, Vb, IKb, SCb, offs_d, offs_dv, skt, svt, smk, Tk, off,
           mu, inv_xmax, has, p)  # fmt: skip
    for start_n in range(k0, c_end, BN):
        acc, wsum, z, mx = _decode_tile(
            acc, wsum, z, mx, start_n, *ctx, D, DV, BD, BDV, BN, CAUSAL, HAS_MASK, QK_NORM,
            REWEIGHT, P_INT, IEEE, UPCAST, SPLIT, POLY, PASS, False,
        )  # fmt: skip
    for start_n in range(c_end, k1, BN):
        acc, wsum, z, mx = _decode_tile(
            acc, wsum, z, mx, start_n, *ctx, D, DV, BD, BDV, BN, CAUSAL, HAS_MASK, QK_NORM,
            REWEIGHT, P_INT, IEEE, UPCAST, SPLIT, POLY, PASS, True,
        )  # fmt: skip
    if PASS == 1:
        tl.store(PROW + slot, z)
        tl.store(PROW + psize + slot, mx)
    else:
        tl.store(PROW + 2 * psize + slot, wsum)
        tl.store(PACC + slot[:, None] * BDV + offs_dv[None, :], acc)


def _configs() -> list[triton.Config]:
    return [
        triton.Config({"BN": bn}, num_warps=w, num_stages=s, maxnreg=MAXNREG)
        for bn, w, s in [(64, 4, 2), (128, 4, 2), (64, 4, 3), (32, 4, 3), (32, 8, 2)]
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Four warps; 128-key blocks only up to head dim 64 (at 128 the LSSAR output pass spilled
    24-112 B on sm_80 / sm_90 with 16 rows). A full tile (rows x head dim =
    :data:`MAX_ROW_ELEMENTS`) in the output pass (``PASS=2``) takes the one 8-warp config, 32-key
    blocks: at 64 rows, head dim 128 the LSSAR pass spilled 112-672 B in every 64-key block (8
    warps too) and the LSSA pass with a mask 40 B in 32-key blocks on 4 warps (255 registers);
    on 8 warps 190-226 registers, no spill (compile_check, sm_80 and sm_90)."""
    dim = max(kwargs["BD"], kwargs["BDV"])
    if kwargs["PASS"] == 2 and kwargs["BM"] * dim >= MAX_ROW_ELEMENTS:
        return [c for c in configs if c.num_warps == 8]
    return [c for c in configs if c.num_warps == 4 and not (dim > 64 and c.kwargs["BN"] > 64)]


decode_tuned = triton.autotune(
    _configs(),
    key=["BM", "BD", "BDV", "REWEIGHT", "PASS", "HAS_MASK", "IEEE", "SPLIT"],
    prune_configs_by={"early_config_prune": _prune},
)(decode_kernel)


def rows_per_program(g: int, t_q: int) -> int:
    """``BM``: the packed rows ``G T_q`` rounded up to a power of two, at least 16 (``tl.dot``)."""
    return max(16, triton.next_power_of_2(g * t_q))


def applies(query: Tensor, key: Tensor, value: Tensor, spans: object) -> bool:
    """Whether a call is a decode step for these kernels: half-precision inputs (fp32 on FMA
    units spilled kilobytes at 64 rows, head dim 256: it keeps the prefill kernels), the packed
    rows fit one tile (``G T_q <= MAX_ROWS``, and rows x head dim within
    :data:`MAX_ROW_ELEMENTS`), no key spans, and no gradient to record (the caller's check)."""
    g = query.shape[1] // key.shape[1]
    dim = triton.next_power_of_2(max(query.shape[-1], value.shape[-1], 16))
    return (
        spans is None
        and query.dtype in (torch.bfloat16, torch.float16)
        and g * query.shape[2] <= MAX_ROWS
        and rows_per_program(g, query.shape[2]) * dim <= MAX_ROW_ELEMENTS
        and key.shape[2] > 0
    )


def splits(programs: int, t_k: int, sms: int, align: int = MAX_BN) -> tuple[int, int]:
    """``(nsplit, span)``: slices of ``span`` keys (a multiple of ``align``, the largest key
    block) so that ``programs`` (batch x kv heads) x ``nsplit`` is about twice the ``sms`` (two
    programs per SM hide one's memory latency behind the other's), and no slice is empty."""
    want = max(1, -(-2 * sms // programs))
    span = -(-max(1, -(-t_k // want)) // align) * align
    return -(-t_k // span), span


__all__ = ["applies", "decode_kernel", "decode_tuned", "rows_per_program", "splits"]
