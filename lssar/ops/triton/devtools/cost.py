"""Static cost of the Triton kernels: SASS counts, an issue-slot model, FlashAttention-2-style refs.

``python -m lssar.ops.triton.devtools.cost [--head-dim 64 128] [--seq-len 4096]
[--tiles first|best]``

**A projection from the compiler's output, not a measurement.** Each kernel the host launches
for a case (causal, no mask, bf16, sm_90) is compiled as in
:mod:`lssar.ops.triton.devtools.compile_check` (same launch recording, same specialisation, same
autotune configs), and the instructions inside its innermost loops (one iteration = one
``BM x BN`` tile) are counted from the SASS (:mod:`lssar.ops.triton.devtools.sass`): issue slots
(every instruction), MUFU (``ex2``, ``lg2``, ``rcp``, ...), and the tensor-core FLOP of the
``HGMMA`` / ``HMMA`` instructions (their shapes), which counts work a tile replicates across
warps as work.

The issue-slot model (one H100 / H200 SXM SM per clock: 4096 dense bf16 tensor FLOP, 16 MUFU
results, 128 issued thread-instructions; 132 SMs at 1.83 GHz, the clock of the 989 TFLOP/s
datasheet figure)::

    clocks per tile = FLOP / 4096 + max(thread-instructions / 128, MUFU / 16)

summed over the tiles each loop visits for one head of a causal problem of ``--seq-len`` rows
(a loop split into a clean interior and a masked diagonal / tail pass visits each its own tiles:
:func:`tile_counts`), divided by the visible scores ``T (T + 1) / 2``. Tensor work and
element-wise work are taken as serial (no overlap between MMAs and the rest: Triton's
software-pipelined loops overlap little of it; FA3's warp specialisation would), latency, memory,
occupancy and dual issue are ignored. The reference is a FlashAttention-2-style softmax of our
own (:func:`fa2_softmax_fwd`, :func:`fa2_softmax_bwd_dkdv`, :func:`fa2_softmax_bwd_dq`: the
Triton tutorial's loops, with its clean-interior / masked-diagonal split), compiled in **its own
best tile** (the lowest modelled time of :data:`FA2_TILES` that compiles without spills): a
kernel's "x FA2-style" is the reference's modelled time over the kernel's.

Calibration (what "x SDPA flash" needs): on the model, the reference forward runs at
``4 D / t`` FLOP per clock per SM; public figures (FA3 paper, H100 SXM, bf16, causal, 16K):
FlashAttention-2 (SDPA's flash backend) 299 / 335 TFLOP/s forward and 291 / 322 backward at head
dim 64 / 128, FA3 473 / 616 and 474 / 561, and Triton's softmax at 0.6-0.8x FA3. The model is
taken to reproduce a Triton softmax at **0.7x FA3** (:data:`TRITON_VS_FA3`); a kernel's projected
"x SDPA flash" is its "x FA2-style" times ``0.7 FA3 / FA2`` (:func:`fa2_factor`) for that head
dim and mode. The model's own TFLOP/s for the reference is printed beside it, so how far the
model is from that assumption can be read off.

One module (~720 lines): the FlashAttention-2-style reference kernels are defined here because
this tool alone compiles them, beside the project's kernels, in the same tiles; moving them
out would give them a module with no other user.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
import triton.language as tl

from lssar.ops.triton.autotune import MAXNREG
from lssar.ops.triton.devtools import compile_check as cc

# ----------------------------------------------------------------------------- the machine


@dataclasses.dataclass(frozen=True)
class Machine:
    """Per SM per clock: dense bf16 tensor FLOP, MUFU results, issued thread-instructions."""

    tensor_flop: float = 4096.0
    mufu: float = 16.0
    issue: float = 128.0
    sms: int = 132
    clock_hz: float = 1.83e9
    hbm_bytes_per_s: float = 4.8e12  # H200 (H100 SXM: 3.35e12)


HOPPER = Machine()
# public figures, TFLOP/s (FA3 paper, H100 SXM5, bf16, causal, sequence length 16K)
FA2_PUBLISHED = {64: {"fwd": 299.0, "bwd": 291.0}, 128: {"fwd": 335.0, "bwd": 322.0}}
FA3_PUBLISHED = {64: {"fwd": 473.0, "bwd": 474.0}, 128: {"fwd": 616.0, "bwd": 561.0}}
TRITON_VS_FA3 = 0.7  # Triton's softmax at 0.6-0.8x FA3 (public); the model's calibration point
BWD_FLOP = 2.5  # backward FLOP / forward FLOP (FlashAttention's convention)


def fa2_factor(head_dim: int, mode: str) -> float:
    """SDPA-flash (FA2) time / the FA2-style reference's time under the calibration
    (``TRITON_VS_FA3 x FA3 / FA2``); ``mode`` "fwd" or "fwd+bwd" (time-weighted)."""
    fa2, fa3 = FA2_PUBLISHED[head_dim], FA3_PUBLISHED[head_dim]
    if mode == "fwd":
        return TRITON_VS_FA3 * fa3["fwd"] / fa2["fwd"]
    t_fa2 = 1 / fa2["fwd"] + BWD_FLOP / fa2["bwd"]
    t_fa3 = 1 / fa3["fwd"] + BWD_FLOP / fa3["bwd"]
    return TRITON_VS_FA3 * t_fa2 / t_fa3


# ----------------------------------------------------------------------------- reference kernels


@triton.jit
def _fa2_fwd_tile(acc, l_i, m_i, q, Kb, Vb, skt, svt, start_n, offs_m, offs_d, qk_scale,
                  BN: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BN)
    k = tl.load(Kb + offs_n[:, None] * skt + offs_d[None, :])
    s = tl.dot(q, tl.trans(k)) * qk_scale  # log2-domain scores
    if MASKED:
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(Vb + offs_n[:, None] * svt + offs_d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def fa2_softmax_fwd(
    Q, K, V, O, LSE, sqt, skt, svt, sot, T, qk_scale,
    BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # The reference point only (never launched by the library; benchmarks/gpu.py times it):
    # FlashAttention-2's causal forward as in Triton's tutorial (online softmax with exp2, one
    # P V product per tile), the key blocks below the diagonal without a mask, the diagonal ones
    # with it; T a multiple of BM; LSE: the rows' log2-sum-exp2 for the backward.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    q = tl.load(Q + pid_bh * T * sqt + offs_m[:, None] * sqt + offs_d[None, :])
    Kb = K + pid_bh * T * skt
    Vb = V + pid_bh * T * svt
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    interior = pid_m * BM // BN * BN
    for start_n in range(0, interior, BN):
        acc, l_i, m_i = _fa2_fwd_tile(
            acc, l_i, m_i, q, Kb, Vb, skt, svt, start_n, offs_m, offs_d, qk_scale, BN, False
        )
    for start_n in range(interior, (pid_m + 1) * BM, BN):
        acc, l_i, m_i = _fa2_fwd_tile(
            acc, l_i, m_i, q, Kb, Vb, skt, svt, start_n, offs_m, offs_d, qk_scale, BN, True
        )
    out = acc / l_i[:, None]
    tl.store(
        O + pid_bh * T * sot + offs_m[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty)
    )
    tl.store(LSE + pid_bh * T + offs_m, m_i + tl.log2(l_i))


@triton.jit
def _fa2_dkdv_tile(dk, dv, k, v, Qb, DOb, LSE, DD, sqt, start_m, offs_n, offs_d,
                   BM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    offs_m = start_m + tl.arange(0, BM)
    q = tl.load(Qb + offs_m[:, None] * sqt + offs_d[None, :])
    do = tl.load(DOb + offs_m[:, None] * sqt + offs_d[None, :])
    m = tl.load(LSE + offs_m)
    di = tl.load(DD + offs_m)
    pt = tl.exp2(tl.dot(k, tl.trans(q)) - m[None, :])  # (BN, BM), key-major
    if MASKED:
        pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do)
    dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - di[None, :])
    dk += tl.dot(dst.to(q.dtype), q)
    return dk, dv


@triton.jit
def fa2_softmax_bwd_dkdv(
    Q, K, V, DO, LSE, DD, DK, DV, sqt, T,
    BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # Reference only: the tutorial's dk/dv loop (one key block per program, scores key-major:
    # every product has M = BN), the query blocks on the diagonal masked, the rest clean.
    # Q, K, V, dO share one layout; LSE in log2 units with the scale folded into q.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    base = pid_bh * T * sqt
    k = tl.load(K + base + offs_n[:, None] * sqt + offs_d[None, :])
    v = tl.load(V + base + offs_n[:, None] * sqt + offs_d[None, :])
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BD), tl.float32)
    Qb = Q + base
    DOb = DO + base
    LSEb = LSE + pid_bh * T
    DDb = DD + pid_bh * T
    first = pid_n * BN // BM * BM
    clean = tl.cdiv((pid_n + 1) * BN, BM) * BM
    for start_m in range(first, clean, BM):
        dk, dv = _fa2_dkdv_tile(
            dk, dv, k, v, Qb, DOb, LSEb, DDb, sqt, start_m, offs_n, offs_d, BM, True
        )
    for start_m in range(clean, T, BM):
        dk, dv = _fa2_dkdv_tile(
            dk, dv, k, v, Qb, DOb, LSEb, DDb, sqt, start_m, offs_n, offs_d, BM, False
        )
    tl.store(DK + base + offs_n[:, None] * sqt + offs_d[None, :], dk.to(DK.dtype.element_ty))
    tl.store(DV + base + offs_n[:, None] * sqt + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _fa2_dq_tile(dq, q, do, m, di, Kb, Vb, sqt, start_n, offs_m, offs_d,
                 BN: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BN)
    k = tl.load(Kb + offs_n[:, None] * sqt + offs_d[None, :])
    v = tl.load(Vb + offs_n[:, None] * sqt + offs_d[None, :])
    p = tl.exp2(tl.dot(q, tl.trans(k)) - m[:, None])
    if MASKED:
        p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - di[:, None])
    dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def fa2_softmax_bwd_dq(
    Q, K, V, DO, LSE, DD, DQ, sqt, T,
    BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # Reference only: the tutorial's dq loop (one query block per program), the key blocks on
    # the diagonal masked, the rest clean.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    base = pid_bh * T * sqt
    q = tl.load(Q + base + offs_m[:, None] * sqt + offs_d[None, :])
    do = tl.load(DO + base + offs_m[:, None] * sqt + offs_d[None, :])
    m = tl.load(LSE + pid_bh * T + offs_m)
    di = tl.load(DD + pid_bh * T + offs_m)
    dq = tl.zeros((BM, BD), tl.float32)
    interior = pid_m * BM // BN * BN
    for start_n in range(0, interior, BN):
        dq = _fa2_dq_tile(
            dq, q, do, m, di, K + base, V + base, sqt, start_n, offs_m, offs_d, BN, False
        )
    for start_n in range(interior, (pid_m + 1) * BM, BN):
        dq = _fa2_dq_tile(
            dq, q, do, m, di, K + base, V + base, sqt, start_n, offs_m, offs_d, BN, True
        )
    tl.store(DQ + base + offs_m[:, None] * sqt + offs_d[None, :], dq.to(DQ.dtype.element_ty))


@triton.jit
def fa2_softmax_decode(
    Q, K, V, PACC, PROW, sqt, skt, Tk, span, nsplit, bhk, qk_scale,
    BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # Reference only: a FlashDecoding (split-K) softmax step, the BM query rows of one kv head's
    # GQA group packed as rows, one slice of the cache per program, online-softmax partials
    # (acc, l, m) for the host to combine (as the decode kernel's partials).
    pid = tl.program_id(0)
    split = pid % nsplit
    bk = (pid // nsplit).to(tl.int64)
    r = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    q = tl.load(Q + (bk * BM + r[:, None]) * sqt + offs_d[None, :])
    Kb = K + bk * Tk * skt
    Vb = V + bk * Tk * skt
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    k0 = split * span
    for start_n in range(k0, tl.minimum(Tk, k0 + span), BN):
        offs_n = start_n + tl.arange(0, BN)
        k = tl.load(Kb + offs_n[:, None] * skt + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vb + offs_n[:, None] * skt + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    slot = (split * bhk + bk) * BM + r
    tl.store(PACC + slot[:, None] * BD + offs_d[None, :], acc)
    tl.store(PROW + slot, l_i)
    tl.store(PROW + nsplit * bhk * BM + slot, m_i)


# candidate tiles (BM, BN, num_warps, num_stages) of the references: Triton's tutorial configs
# and their neighbours; the best by the model that compiles without spilling is the reference
FA2_TILES = {
    "fwd": [
        (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 2),
        (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 128, 4, 2),
    ],
    "dkdv": [
        (32, 128, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2), (16, 128, 4, 2),
        (32, 128, 8, 2),
    ],
    "dq": [
        (128, 32, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2),
        (128, 64, 4, 2),
    ],
}  # fmt: skip
_FA2_KERNELS = {"fwd": fa2_softmax_fwd, "dkdv": fa2_softmax_bwd_dkdv, "dq": fa2_softmax_bwd_dq}
# the decode reference: 16 packed rows (the decode kernel's BM for G T_q <= 16)
FA2_DECODE_TILES = [(16, 64, 4, 2), (16, 128, 4, 2), (16, 64, 4, 3), (16, 32, 4, 3)]
_FA2_KERNELS["decode"] = fa2_softmax_decode


def _fa2_build(kind: str, head_dim: int, dtype: str, tile: tuple, arch: int) -> cc.Build:
    bm, bn, warps, stages = tile
    t = cc.SEQ_LEN
    dt = cc._DTYPES[dtype]
    x = torch.zeros(cc.BATCH * cc.HEADS, t, head_dim, dtype=dt)
    row = torch.zeros(cc.BATCH * cc.HEADS, t, dtype=torch.float32)
    if kind == "fwd":
        args = (x, x, x, x, row, head_dim, head_dim, head_dim, head_dim, t, 1.0)
    elif kind == "decode":
        args = (x, x, x, x, row, head_dim, head_dim, t, t, 1, cc.BATCH, 1.0)
    elif kind == "dkdv":
        args = (x, x, x, x, row, row, x, x, head_dim, t)
    else:
        args = (x, x, x, x, row, row, x, head_dim, t)
    kernel = _FA2_KERNELS[kind]
    cfg = triton.Config({"BM": bm, "BN": bn}, num_warps=warps, num_stages=stages, maxnreg=MAXNREG)
    kw = {"BD": head_dim, **cfg.all_kwargs()}
    sig, cst, attrs, opts = cc.specialise(kernel, args, kw, arch)
    case = cc.Case(head_dim, dtype, True, "softmax", False)
    return cc.Build(
        case, f"fa2 {kind}", cc._config_label(cfg), arch, True, __name__, kernel.fn.__name__,
        sig, cst, attrs, opts, cc._cache_key(kernel, sig, cst, attrs, opts, arch),
    )  # fmt: skip


# ----------------------------------------------------------------------------- the model


def _tile(config: str) -> tuple[int, int, int]:
    bm, bn = (int(x) for x in config.split()[0].split("x"))
    return bm, bn, int(config.split()[1][1:])


def tile_counts(kind: str, seq_len: int, bm: int, bn: int) -> tuple[int, int]:
    """``(clean, masked)`` tiles one head of a causal ``seq_len x seq_len`` problem visits in a
    kernel whose loop is split into a clean interior and a masked pass over the diagonal: row
    kernels (``BM`` query rows per program, over key blocks) or the key-major dk/dv kernels
    (``BN`` keys per program, over query blocks). A tile is clean when every score in it is
    visible (and in range); one with no visible score is never visited."""
    clean = masked = 0
    if kind in ("dkdv", "fa2 dkdv"):
        for n0 in range(0, seq_len, bn):
            for m0 in range(n0 // bm * bm, seq_len, bm):
                full = m0 >= n0 + bn - 1 and m0 + bm <= seq_len and n0 + bn <= seq_len
                clean += full
                masked += not full
        return clean, masked
    for m0 in range(0, seq_len, bm):
        for n0 in range(0, min(seq_len, m0 + bm), bn):
            full = n0 + bn - 1 <= m0 and n0 + bn <= seq_len and m0 + bm <= seq_len
            clean += full
            masked += not full
    return clean, masked


def _passes(kind: str, row: dict) -> int:
    """Loops over the tiles a kernel makes (before splitting): the LSSAR forward two; a
    one-grad dk/dv tile two, one per program role (each tile is visited by a dk and a dv
    program)."""
    if kind in ("fwd", "fwd-train"):
        return 2 if row["variant"] == "lssar" else 1
    return 2 if "one-grad" in row["config"] else 1


@dataclasses.dataclass
class KernelCost:
    """One compiled kernel's modelled cost for one head of a causal problem: ``clocks`` per
    visible score on one SM (tensor, issue, MUFU parts), and per computed score element the
    instruction counts of the SASS (``per_element``: every loop weighted by its tiles)."""

    name: str
    config: str
    loops: int
    per_element: dict[str, float]
    tensor: float
    issue: float
    mufu: float
    unsplit: float  # the clocks with every tile in the masked loop (no clean interior)

    @property
    def clocks(self) -> float:
        """Modelled SM clocks per visible score: tensor + max(issue, MUFU)."""
        return self.tensor + max(self.issue, self.mufu)


_COUNTED = ("total", "ex2", "lg2", "rcp", "mufu", "atomic", "local", "flop")


def kernel_cost(row: dict, seq_len: int, machine: Machine = HOPPER) -> KernelCost:
    """The model applied to a compile-check row (its per-loop SASS counts)."""
    kind = row["kernel"]
    bm, bn, warps = _tile(row["config"])
    each = row["loop"]["each"]
    passes = 1 if kind.startswith("fa2") else _passes(kind, row)
    clean, masked = tile_counts(kind, seq_len, bm, bn)
    if len(each) == passes:  # one loop per pass over every tile
        tiles = [clean + masked] * passes
        whole = tiles
    elif len(each) == 2 * passes:  # each pass split: clean interior, then the masked pass
        tiles = [clean, masked] * passes
        whole = [0, clean + masked] * passes  # every tile masked: the split's counterfactual
    else:
        raise RuntimeError(
            f"{row['case']} {kind} {row['config']}: {len(each)} innermost loops, expected "
            f"{passes} or {2 * passes}"
        )
    visible = seq_len * (seq_len + 1) / 2

    def clocks(counts: list[int]) -> tuple[dict, float, float, float]:
        # per program and tile: thread-instructions = count x 32 x warps; FLOP = per-warp x warps
        sums = {c: sum(t * lp[c] for t, lp in zip(counts, each)) for c in _COUNTED}
        thread = {c: v * 32 * warps for c, v in sums.items() if c != "flop"}
        flop = sums["flop"] * warps
        tensor = flop / machine.tensor_flop / visible
        busy = max(thread["total"] / machine.issue, thread["mufu"] / machine.mufu) / visible
        return thread, flop, tensor, tensor + busy

    thread, flop, _, _ = clocks(tiles)
    *_, unsplit = clocks(whole)
    computed = sum(tiles) / passes * bm * bn  # each tile once, whatever visits it
    per_element = {c: v / computed for c, v in thread.items()}
    per_element["flop"] = flop / computed
    return KernelCost(
        row["kernel"] if kind.startswith("fa2") else f"{row['variant']} {kind}",
        row["config"],
        len(each),
        per_element,
        flop / machine.tensor_flop / visible,
        thread["total"] / machine.issue / visible,
        thread["mufu"] / machine.mufu / visible,
        unsplit,
    )


# ----------------------------------------------------------------------------- the table


@dataclasses.dataclass
class Projection:
    """A case's kernels and its modelled times beside the FA2-style reference's."""

    label: str
    head_dim: int
    kernels: list[KernelCost]
    fwd: float  # clocks per visible score: the inference forward
    train_fwd: float  # the forward that keeps what the backward needs (LSSAR: F_i vectors)
    bwd: float
    ref_fwd: float
    ref_bwd: float
    spilled: list[str]  # kept configs that spill (left out of the projection: compile_check)

    @property
    def x_fwd(self) -> float:
        """Speed relative to the FA2-style forward (higher is faster)."""
        return self.ref_fwd / self.fwd

    @property
    def x_fwd_bwd(self) -> float:
        """Speed of forward + backward relative to the FA2-style pair."""
        return (self.ref_fwd + self.ref_bwd) / (self.train_fwd + self.bwd)


def reference(
    head_dim: int, dtype: str, arch: int, seq_len: int, jobs: int
) -> dict[str, KernelCost]:
    """The FA2-style kernels (fwd, dkdv, dq), each in its own best tile by the model among
    :data:`FA2_TILES` that compile without spills."""
    blds = [
        _fa2_build(k, head_dim, dtype, t, arch) for k, tiles in FA2_TILES.items() for t in tiles
    ]
    rows = cc.run(blds, jobs)
    best: dict[str, KernelCost] = {}
    for r in rows:
        if not r["ok"] or r["spill_store"] or r["shared"] > r["shared_limit"]:
            continue
        kc = kernel_cost(r, seq_len)
        kind = r["kernel"].split()[1]
        if kind not in best or kc.clocks < best[kind].clocks:
            best[kind] = kc
    return best


def _case_rows(case: cc.Case, arch: int, tiles: str, jobs: int) -> list[dict]:
    """Compile-check rows of every kernel the host launches for ``case``: the first kept config
    of each (``tiles="first"``) or every kept config (``"best"``)."""
    blds, seen = [], set()
    for b in cc.builds([case], (arch,), kept_only=True):
        if tiles == "best" or b.kernel not in seen:
            seen.add(b.kernel)
            blds.append(b)
    rows = cc.run(blds, jobs)
    bad = [f"{r['case']} {r['kernel']} {r['config']}: {r['error']}" for r in rows if not r["ok"]]
    if bad:
        raise RuntimeError("; ".join(bad))
    return rows


def project(
    case: cc.Case, ref: dict[str, KernelCost], arch: int, seq_len: int, tiles: str, jobs: int
) -> Projection:
    """The model for every kernel of ``case`` (the best of its kept tiles, or the first)."""
    best: dict[str, KernelCost] = {}
    spilled = []
    for r in _case_rows(case, arch, tiles, jobs):
        if r["loop"]["loops"] == 0:  # the rows kernel: per-row work only, no key loop
            continue
        if r["spill_store"]:
            spilled.append(f"{r['kernel']} {r['config']} ({r['spill_store']} B)")
            continue
        kc = kernel_cost(r, seq_len)
        if r["kernel"] not in best or kc.clocks < best[r["kernel"]].clocks:
            best[r["kernel"]] = kc
    kernels = list(best.values())
    fwd = best["fwd"].clocks
    train = best.get("fwd-train", best["fwd"]).clocks
    bwd = sum(k.clocks for name, k in best.items() if not name.startswith("fwd"))
    return Projection(
        case.label, case.head_dim, kernels, fwd, train, bwd, ref["fwd"].clocks,
        ref["dkdv"].clocks + ref["dq"].clocks, spilled,
    )  # fmt: skip


def cases(head_dim: int, dtype: str = "bf16") -> list[cc.Case]:
    """The cases of the table: lssa and lssar (p = 15), causal, no mask, precise False / True."""
    return [
        cc.Case(head_dim, dtype, True, v, False, precise=p)
        for v in ("lssa", "lssar")
        for p in (False, True)
    ]


def tflops(head_dim: int, clocks: float, machine: Machine = HOPPER) -> float:
    """Modelled forward TFLOP/s (``4 D`` FLOP per visible score, the softmax convention)."""
    return 4 * head_dim / clocks * machine.sms * machine.clock_hz / 1e12


def markdown_kernels(ref: dict[str, KernelCost], projs: list[Projection]) -> str:
    """Per kernel: tile, loops, per computed score element (thread-instructions, MUFU, tensor
    FLOP, spills) and the modelled clocks per visible score."""
    lines = [
        "| case | kernel | tile | loops | instr / elem | MUFU / elem | FLOP / elem | STL+LDL "
        "| tensor clk | issue clk | MUFU clk | clk / score | clk unsplit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def line(label: str, k: KernelCost) -> str:
        pe = k.per_element
        return (
            f"| {label} | {k.name} | {k.config} | {k.loops} | {pe['total']:.1f} | "
            f"{pe['mufu']:.2f} | {pe['flop']:.0f} | {pe['local']:.2f} | {k.tensor:.3f} | "
            f"{k.issue:.3f} | {k.mufu:.3f} | {k.clocks:.3f} | {k.unsplit:.3f} |"
        )

    for k in ref.values():
        lines.append(line("softmax (reference)", k))
    for p in projs:
        lines += [line(p.label, k) for k in p.kernels]
    return "\n".join(lines)


def markdown_summary(ref: dict[str, KernelCost], projs: list[Projection]) -> str:
    """Per case: modelled clocks per score, x FA2-style and the projected x SDPA flash."""
    d = projs[0].head_dim
    fwd_model = tflops(d, ref["fwd"].clocks)
    ref_pair = ref["fwd"].clocks + ref["dkdv"].clocks + ref["dq"].clocks
    lines = [
        f"Head dim {d}: the FA2-style forward models at {fwd_model:.0f} TFLOP/s "
        f"(calibration: Triton softmax = {TRITON_VS_FA3} x FA3 = "
        f"{TRITON_VS_FA3 * FA3_PUBLISHED[d]['fwd']:.0f}); x SDPA flash = x FA2-style x "
        f"{fa2_factor(d, 'fwd'):.2f} (fwd), x {fa2_factor(d, 'fwd+bwd'):.2f} (fwd+bwd).",
        "",
        "| case | fwd clk / score | fwd x FA2-style | fwd x SDPA flash (projected) "
        "| fwd+bwd clk / score | fwd+bwd x FA2-style | fwd+bwd x SDPA flash (projected) |",
        "|---|---|---|---|---|---|---|",
        f"| FA2-style softmax (reference) | {ref['fwd'].clocks:.3f} | 1.00 | "
        f"{fa2_factor(d, 'fwd'):.2f} | {ref_pair:.3f} | 1.00 | {fa2_factor(d, 'fwd+bwd'):.2f} |",
    ]
    for p in projs:
        lines.append(
            f"| {p.label} | {p.fwd:.3f} | {p.x_fwd:.2f} | {p.x_fwd * fa2_factor(d, 'fwd'):.2f} | "
            f"{p.train_fwd + p.bwd:.3f} | {p.x_fwd_bwd:.2f} | "
            f"{p.x_fwd_bwd * fa2_factor(d, 'fwd+bwd'):.2f} |"
        )
    spills = [f"{p.label}: {', '.join(p.spilled)}" for p in projs if p.spilled]
    if spills:
        lines += ["", "Kept configs that spill (left out; to be pruned):", *spills]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- decode


@dataclasses.dataclass
class DecodeCost:
    """One decode launch's modelled time for one kv head's step (``clocks`` of the whole GPU:
    the slices spread over every SM), its compute and HBM parts."""

    name: str
    config: str
    compute: float
    memory: float

    @property
    def clocks(self) -> float:
        """Memory and compute overlap (many programs per SM): the larger one."""
        return max(self.compute, self.memory)


def decode_cost(row: dict, t_k: int, kv_bytes: float, machine: Machine = HOPPER) -> DecodeCost:
    """The model for a decode launch (compile-check row): ``t_k / BN`` clean key blocks per kv
    head (loop 0 of each launch), their SASS clocks spread over the SMs, against ``kv_bytes``
    read or written from HBM per kv head."""
    bm, bn, warps = _tile(row["config"])
    # the clean loop: the first with a matrix product (LSSAR's pass 2 first loops over the
    # slices' statistics; the masked loop only takes a ragged tail)
    lp = next(lp for lp in row["loop"]["each"] if lp["flop"] > 0)
    tiles = t_k / bn
    thread = 32 * warps * tiles
    tile_clk = lp["flop"] * warps * tiles / machine.tensor_flop + max(
        lp["total"] * thread / machine.issue, lp["mufu"] * thread / machine.mufu
    )
    hbm = machine.hbm_bytes_per_s / machine.clock_hz  # bytes per clock, whole chip
    name = row["kernel"] if row["kernel"].startswith("fa2") else f"{row['variant']} {row['kernel']}"
    return DecodeCost(name, row["config"], tile_clk / machine.sms, kv_bytes / hbm)


def decode_projection(
    head_dim: int, dtype: str, arch: int, t_k: int, g: int, jobs: int
) -> tuple[list[DecodeCost], dict[str, list[DecodeCost]]]:
    """A decode step (``g`` query heads per kv head, one query each, ``t_k`` cached keys): the
    FlashDecoding-style softmax reference in its best tile, and each case's launches (LSSA one,
    LSSAR two) in their best configs. Bytes per kv head: K and V read once (softmax, LSSA);
    LSSAR reads K in pass 1 and writes ``4 g`` bytes of scores per key, and reads them back with
    V in pass 2."""
    esize = cc._DTYPES[dtype].itemsize
    kv = t_k * head_dim * esize
    scores = t_k * 4 * g
    blds = [_fa2_build("decode", head_dim, dtype, t, arch) for t in FA2_DECODE_TILES]
    ref = min(
        (
            decode_cost(r, t_k, 2 * kv)
            for r in cc.run(blds, jobs)
            if r["ok"] and not r["spill_store"]
        ),
        key=lambda c: c.clocks,
    )
    out: dict[str, list[DecodeCost]] = {}
    for variant in ("lssa", "lssar"):  # precise=False: memory-bound, the split barely shows
        for precise in (False,):
            case = cc.Case(head_dim, dtype, True, variant, False, precise=precise, decode=16)
            rows = cc.run(cc.builds([case], (arch,)), jobs)
            best: dict[str, DecodeCost] = {}
            for r in rows:
                if not r["ok"] or r["spill_store"]:
                    continue
                kv_bytes = {"decode1": kv + scores, "decode2": kv + scores}[r["kernel"]]
                if variant == "lssa":
                    kv_bytes = 2 * kv
                c = decode_cost(r, t_k, kv_bytes)
                if r["kernel"] not in best or c.clocks < best[r["kernel"]].clocks:
                    best[r["kernel"]] = c
            out[case.label] = list(best.values())
    return [ref], out


def markdown_decode(ref: list[DecodeCost], cases: dict[str, list[DecodeCost]]) -> str:
    """Per case: each launch's compute and memory clocks, the step's total, x the reference."""
    t_ref = sum(c.clocks for c in ref)
    lines = [
        "| case | launch | config | compute clk | HBM clk | clk | step x softmax split-K |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, launches in [("softmax split-K (reference)", ref), *cases.items()]:
        total = sum(c.clocks for c in launches)
        for i, c in enumerate(launches):
            ratio = f"{t_ref / total:.2f}" if i == len(launches) - 1 else ""
            lines.append(
                f"| {label} | {c.name} | {c.config} | {c.compute:.0f} | {c.memory:.0f} | "
                f"{c.clocks:.0f} | {ratio} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: print the tables."""
    ap = argparse.ArgumentParser(prog="python -m lssar.ops.triton.devtools.cost")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], choices=(64, 128))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--arch", type=int, default=90, choices=cc.ARCHS)
    ap.add_argument(
        "--seq-len", type=int, default=4096, help="causal problem length (default 4096)"
    )
    ap.add_argument(
        "--tiles", default="first", choices=("first", "best"),
        help="each kernel in its first kept config (quick) or the best kept one by the model",
    )  # fmt: skip
    ap.add_argument("--variant", nargs="+", default=None, help="only these case labels' variants")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--decode", type=int, nargs=2, metavar=("G", "T_K"), default=None,
        help="the decode table instead: G query heads per kv head, T_K cached keys",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if a.decode:
        for d in a.head_dim:
            ref, out = decode_projection(d, a.dtype, a.arch, a.decode[1], a.decode[0], a.jobs)
            print(f"## decode, head dim {d}, {a.dtype}, sm_{a.arch}, G = {a.decode[0]}, "
                  f"T_k = {a.decode[1]}\n")  # fmt: skip
            print(markdown_decode(ref, out) + "\n", flush=True)
        return 0
    if a.seq_len % 128:
        ap.error("--seq-len must be a multiple of 128")
    for d in a.head_dim:
        ref = reference(d, a.dtype, a.arch, a.seq_len, a.jobs)
        todo = [c for c in cases(d, a.dtype) if a.variant is None or c.variant in a.variant]
        projs = [project(c, ref, a.arch, a.seq_len, a.tiles, a.jobs) for c in todo]
        print(f"## head dim {d}, {a.dtype}, sm_{a.arch}, causal, T = {a.seq_len}\n")
        print(markdown_summary(ref, projs) + "\n")
        print(markdown_kernels(ref, projs) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
