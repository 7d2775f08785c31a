"""Autotuning of the kernels in :mod:`lssar.ops.triton.kernels`: their configurations, the pruning
that keeps only configs expected to run without register spills within shared memory (:func:`fits`,
``MEASURED_SPILLS``), the autotuning key and the autotuned launchers
(``fwd_tuned``, ``rows_tuned``, ``dq_tuned``, ``dkdv_tuned``) that :mod:`lssar.ops.triton.host`
launches. Host code only: no device code here (so editing it leaves the compile check's cache,
keyed by the kernels' source, valid).
"""

from typing import Any

import torch
import triton

from lssar.ops.triton.kernels import bwd_dkdv_kernel, bwd_dq_kernel, bwd_rows_kernel, fwd_kernel

# (the autotuner adds the tensors' dtypes; IEEE tells fp32 inputs in IEEE from fp32 on TF32 tensor
# cores, which the host picks per launch from torch's flag)
_TUNE_KEY = [
    "tq_key", "tk_key", "BD", "BDV", "CAUSAL", "HAS_MASK", "REWEIGHT", "P_INT", "SPLIT",
    "HAS_SPANS", "HAS_SINKS", "IEEE",
]  # fmt: skip


# Registers per thread a block may use: the hardware's 255 (the kernels launch at most 256
# threads). Without the bound ptxas chose, for some fp32 tiles, 72-168 registers (2-4 blocks per
# SM) and spilled 4-20 B to stay there; with it, the same PTX compiled without spills (fp32 dq at
# head dim 256, 16x16, 4 warps, sm_80: 128 registers + 8 B spilled -> 180 registers, 0).
MAXNREG = 255


def _configs(shapes: list[tuple[int, int, int, int]], **flags: bool) -> list[triton.Config]:
    return [
        triton.Config({"BM": m, "BN": n, **flags}, num_warps=w, num_stages=s, maxnreg=MAXNREG)
        for m, n, w, s in shapes
    ]


# Every config is checked ahead of time by ``python -m lssar.ops.triton.devtools.compile_check``
# (sm_80 and sm_90: registers, spills, shared memory; tests/ops/test_triton_compile.py); the limits
# below are set from its measurements, a little inside the first spilling tile of each kernel.
SHARED_BUDGET = 163 * 1024  # sm_80's per-block maximum, the smallest of the supported GPUs
# Live fp32 words per thread (_live_words) above which ptxas spilled, per kernel. Examples:
# forward at head dim 128: 64x32 tile, 4 warps: 64 + 3 * 16 = 112 words, spills; 64x64, 8 warps:
# 80, does not; dk/dv at 256, 64x32, 8 warps: 152, spills; at 128, 32x32, 4 warps: 120, does
# not. Tiles within the limits that spilled anyway are listed in MEASURED_SPILLS.
REG_BUDGET = {"fwd": 80, "dq": 80, "dkdv": 120}
# The same for fp32 inputs on TF32 tensor cores (IEEE=False): the MMA operands are 32-bit, twice
# the registers of half-precision ones. Set from 192 kept builds (lssar d64/128/256 causal, d128
# with sinks, non-causal with a mask, lssa d128; sm_80 and sm_90) under the half-precision budgets:
# 9 spilled 12-40 B (fwd at 80 words, dq at 40-56, dk/dv at 54 and 70); ptxas runs several of the
# rest at 250-255 registers. Tiles within these that spilled anyway: MEASURED_SPILLS ("tf32").
TF32_REG_BUDGET = {"fwd": 64, "dq": 32, "dkdv": 44}
# fp32 inputs multiply on FMA units (IEEE, no tensor cores): each thread then holds a slice of
# both operands, which spills at any tile above a few score elements per thread (measured: 2 fit
# at head dim 256 with 4 warps, except where MEASURED_SPILLS says; 1, with 8 warps, fits there
# too; 4 spill). dk/dv's transposed FMA products spill at every tile when software pipelined
# (num_stages > 1), even 16x16; unpipelined, one score per thread fits at 256.
FMA_SCORES_PER_THREAD = {"fwd": 2, "dq": 2, "dkdv": 1}


def _live_words(
    kind: str,
    bm: int,
    bn: int,
    warps: int,
    bd: int,
    bdv: int,
    esize: int = 2,
    one_grad: bool = False,
    fold: bool = False,
) -> float:
    """Estimated live fp32 words per thread in a kernel's loop: its fp32 accumulators and ~3
    score-shaped fp32 tiles (scores, weights, dP / dS); dk/dv also reloads q and dO tiles
    (``esize``-byte inputs: two half-precision values per word) every iteration; ``one_grad``:
    a dk/dv program holds dk or dv, not both (``ONE_GRAD``); ``fold``: the LSSAR forward's
    second accumulator for the backward's F_i (``FOLD_F``)."""
    threads = 32 * warps
    grads = max(bd, bdv) if one_grad else bd + bdv
    acc = {"fwd": bm * bdv * (2 if fold else 1), "dq": bm * bd, "dkdv": bn * grads}[kind]
    reloaded = bm * (bd + bdv) * esize / 4 if kind == "dkdv" else 0
    return (acc + reloaded + 3 * bm * bn) / threads


def _cfg_words(
    kind: str, cfg: triton.Config, bd: int, bdv: int, esize: int, fold: bool = False
) -> float:
    """:func:`_live_words` of a config."""
    bm, bn = cfg.kwargs["BM"], cfg.kwargs["BN"]
    one_grad = bool(cfg.kwargs.get("ONE_GRAD", False))
    return _live_words(kind, bm, bn, cfg.num_warps, bd, bdv, esize, one_grad, fold)


def _shared_bytes(kind: str, bm: int, bn: int, stages: int, bd: int, bdv: int, esize: int) -> int:
    """Estimated shared memory per block: the pipelined tiles of the loop (``stages`` copies of
    k, v; or q, dO for dk/dv) and the resident ones (what sm_90's wgmma reads from shared)."""
    if kind == "dkdv":
        return (stages * bm + bn) * (bd + bdv) * esize
    resident = bm * bd if kind == "fwd" else bm * (bd + bdv)
    return (stages * bn * (bd + bdv) + resident) * esize


# Where a measured tile spilled: launches with neither a mask nor key spans, with a mask
# (HAS_MASK), with key spans (HAS_SPANS); a launch with both is both.
PLAIN, MASK, SPANS = "plain", "mask", "spans"
ANYWHERE = frozenset({PLAIN, MASK, SPANS})
_SPANS_ONLY = frozenset({SPANS})
# Tiles inside the limits above that ptxas still spilled (a few bytes to a few hundred; most were
# measured before MAXNREG, when ptxas capped some blocks at 72-168 registers), per (kernel, padded
# head dim, precision, BM, BN, num_warps, num_stages) -> the launches they are pruned from.
# Precision: "half" (bf16 / fp16; those that spilled anywhere also bind fp32 on TF32), "tf32" (fp32
# inputs on TF32 tensor cores, IEEE=False), "ieee" (fp32 on FMA units). Measured by compile_check
# on sm_80 and sm_90 (LSSAR p=15 and LSSA, causal or not, with and without a mask, with key spans:
# a window, sinks): the kernels sit near 255 registers at most tiles. A tile that spilled in a
# launch without a mask or spans is pruned everywhere; one that spilled only with spans (the
# rows' bounds and the data-dependent loop bounds hold a few more registers) or a mask only there.
MEASURED_SPILLS: dict[tuple, frozenset[str]] = {
    **dict.fromkeys(
        [
            ("fwd", 64, "half", 64, 32, 4, 2),
            ("fwd", 128, "half", 64, 64, 8, 3),
            ("fwd", 128, "half", 64, 64, 8, 2),  # 16 B sm_80 fp16 full; 4-24 B with a mask
            ("fwd", 128, "half", 16, 64, 4, 2),
            ("fwd", 256, "half", 16, 64, 4, 2),
            ("fwd", 256, "half", 16, 32, 4, 2),
            ("dq", 64, "half", 64, 64, 8, 3),
            ("dq", 64, "half", 64, 64, 8, 2),
            ("dq", 128, "half", 64, 64, 8, 3),
            ("dq", 128, "half", 64, 64, 8, 2),
            ("dq", 256, "half", 16, 64, 4, 2),
            ("dkdv", 64, "half", 32, 64, 8, 2),
            ("dkdv", 64, "half", 64, 32, 4, 2),
            ("dkdv", 64, "half", 64, 32, 8, 2),
            ("dkdv", 128, "half", 64, 32, 8, 2),
            ("dkdv", 128, "half", 32, 64, 8, 2),  # 16-36 B sm_90 lssa full
            ("dkdv", 128, "half", 32, 32, 8, 2),
            ("dkdv", 256, "half", 32, 32, 8, 2),
            ("dkdv", 256, "half", 16, 16, 4, 2),
            # fp32 on TF32 tensor cores (4 to 44 B; ptxas often caps these 256-thread blocks at
            # 128 registers, or sits at 255): in the calibration cases of TF32_REG_BUDGET and
            # seven more (lssar d64 / d256 non-causal with a mask, d64 / d256 with sinks, d128
            # with a window; lssa d128 with sinks, lssa d64 causal), then the full grid
            ("fwd", 64, "tf32", 128, 32, 8, 2),  # 16 B, sm_80, lssar causal (over the budget)
            ("fwd", 128, "tf32", 64, 64, 8, 2),  # 40 B, sm_80, lssar mask (over the budget)
            ("fwd", 128, "tf32", 16, 32, 4, 2),  # 4 B, sm_90, lssar causal
            ("fwd", 256, "tf32", 16, 16, 4, 2),  # 8 B, sm_90, lssar full
            ("dq", 128, "tf32", 64, 32, 8, 2),  # 12 B, sm_90, lssar mask (over the budget)
            ("dq", 128, "tf32", 16, 64, 4, 2),  # 12-28 B, lssar mask, sinks (over the budget)
            ("dq", 256, "tf32", 16, 32, 4, 2),  # 12 B, sm_90, lssar causal (over the budget)
            ("dkdv", 128, "tf32", 16, 32, 8, 2),  # 12 B, sm_90, lssar sinks (over the budget)
            ("dkdv", 128, "tf32", 16, 16, 4, 2),  # 12 B, sm_90, lssar mask (over the budget)
            ("fwd", 64, "tf32", 64, 64, 8, 3),  # 44 B, sm_80, lssar sinks
            ("fwd", 64, "tf32", 64, 64, 8, 2),  # 44 B, sm_80, lssar sinks
            ("dkdv", 64, "tf32", 32, 32, 8, 2),  # 4 B, sm_90, lssar mask
            ("dkdv", 64, "tf32", 16, 32, 8, 2),  # 8 B, sm_80, lssa causal
            ("dkdv", 256, "tf32", 16, 16, 8, 1),  # 16 B, sm_80, lssar sinks (128 registers)
            # fp32 on FMA units: one score per thread (8 warps) at head dim 128-256 where two
            # spill (4-20 B, sm_80, capped at 80 / 128 registers)
            ("fwd", 128, "ieee", 16, 16, 4, 2),  # 4 B lssar full
            ("fwd", 256, "ieee", 16, 16, 4, 2),  # 4 B lssar full, 16 B sinks
        ],
        ANYWHERE,
    ),
    ("dq", 256, "ieee", 16, 16, 4, 2): frozenset({PLAIN, MASK}),  # 8-20 B; 0 with sinks
    ("dq", 128, "ieee", 16, 16, 4, 2): frozenset({MASK}),  # 28-52 B at 255 registers
    # 8-20 B sm_80, lssar bf16 with a mask, at 255 registers (0 on sm_90), from the full grid's
    # kept-only check; since dq was fused into dk/dv also without (8 B): SPILL_ARCHS
    ("fwd", 64, "half", 64, 64, 8, 2): ANYWHERE,
    # the reduced grid, kept-only (2026-12-04): dk/dv with the fused dq at head dim 128, 16-152 B
    # on sm_80 and sm_90 (lssa, lssar; fast, precise, a mask, sinks); the LSSAR training
    # forward (FOLD_F: "fwd-train", looked up for those launches) at head dim 64, 20-304 B
    ("dkdv", 128, "half", 32, 32, 4, 2): ANYWHERE,
    ("fwd-train", 64, "half", 64, 64, 8, 3): ANYWHERE,
    ("fwd-train", 64, "half", 64, 64, 8, 2): ANYWHERE,
    ("fwd-train", 64, "half", 64, 32, 8, 2): ANYWHERE,  # 8 B sm_80
    **dict.fromkeys(
        [
            ("dq", 64, "half", 64, 32, 4, 2),
            ("dkdv", 128, "half", 16, 16, 8, 1),
            ("dkdv", 256, "half", 16, 16, 8, 1),
            ("dq", 256, "ieee", 16, 16, 8, 2),  # 8-12 B lssar sinks
        ],
        _SPANS_ONLY,
    ),
    # 8 B sm_90 lssa with a window; 4 B sm_90 lssa causal with a mask
    ("dkdv", 256, "tf32", 16, 32, 8, 2): frozenset({SPANS, MASK}),
}
# The archs a MEASURED_SPILLS tile spilled on where that was one of the two (the rest: both): the
# pruning is per arch (_measured), so such a tile stays a candidate on the other.
SPILL_ARCHS: dict[tuple, frozenset[int]] = {
    **dict.fromkeys(
        [
            ("fwd", 64, "half", 64, 64, 8, 2),
            ("fwd-train", 64, "half", 64, 32, 8, 2),
            ("fwd", 64, "tf32", 128, 32, 8, 2),
            ("fwd", 128, "tf32", 64, 64, 8, 2),
            ("fwd", 64, "tf32", 64, 64, 8, 3),
            ("fwd", 64, "tf32", 64, 64, 8, 2),
            ("dkdv", 64, "tf32", 16, 32, 8, 2),
            ("dkdv", 256, "tf32", 16, 16, 8, 1),
            ("fwd", 128, "ieee", 16, 16, 4, 2),
            ("fwd", 256, "ieee", 16, 16, 4, 2),
        ],
        frozenset({80}),
    ),
    **dict.fromkeys(
        [
            ("fwd", 128, "tf32", 16, 32, 4, 2),
            ("fwd", 256, "tf32", 16, 16, 4, 2),
            ("dq", 128, "tf32", 64, 32, 8, 2),
            ("dq", 256, "tf32", 16, 32, 4, 2),
            ("dkdv", 128, "tf32", 16, 32, 8, 2),
            ("dkdv", 128, "tf32", 16, 16, 4, 2),
            ("dkdv", 64, "tf32", 32, 32, 8, 2),
            ("dkdv", 256, "tf32", 16, 32, 8, 2),
        ],
        frozenset({90}),
    ),
}


def device_arch() -> int | None:
    """The current CUDA device's compute capability as an integer (``80``, ``90``), or None
    without one (the compile check sets it per target arch)."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


# Row tiles over two warpgroups (128 rows, 8 warps: on sm_90 each warpgroup's wgmma takes 64
# rows, so no element-wise work is done twice, as it is in a 64-row tile with 8 warps): kept on
# sm_90 where measured without spills, per (kernel, BM, BN, num_warps, num_stages) -> the
# (padded head dim, LSSAR, precise, FOLD_F) launches, half precision, neither mask nor spans;
# 128x64 and 128x128 nowhere else, 128x32 also where the estimates keep it (it predates these
# lists). Measured by compile_check on sm_90, bf16, causal (docs/history/RESULTS.md, 2026-12-04;
# the spilling ones: 128x64 for lssa precise at 128 (64 B), lssar precise at 128 (80 B) and
# every LSSAR training forward at 64 and 128 (8-1428 B); 128x128 for every LSSAR launch and
# lssa precise (84-4408 B); 128x32 for the LSSAR training forward precise (24-352 B)). Not
# measured on sm_80.
WGMMA_ROW_TILES = {(128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 2)}
MEASURED_WGMMA_ROWS: dict[tuple, frozenset[tuple[int, bool, bool, bool]]] = {
    ("fwd", 128, 64, 8, 2): frozenset(
        [(64, False, False, False), (64, False, True, False), (128, False, False, False)]
        + [(64, True, False, False), (64, True, True, False), (128, True, False, False)]
    ),
    ("fwd", 128, 128, 8, 2): frozenset([(64, False, False, False), (128, False, False, False)]),
    ("fwd", 128, 32, 8, 2): frozenset(
        [(128, False, False, False), (128, False, True, False), (128, True, False, False)]
        + [(128, True, True, False), (128, True, False, True), (64, True, False, True)]
    ),
}


# Key-major dk/dv tiles (for sm_90's wgmma: all four products HGMMA): per (BM, BN, num_warps,
# num_stages, ONE_GRAD), the largest padded head dim at which the tile compiled without spills in
# every measured case; kept for half-precision inputs up to it, never for fp32 (not measured).
# Measured by compile_check on sm_80 and sm_90 at head dim 64 and 128, 6 cases each (bf16 LSSAR
# p=15 causal, with sinks, with a window; bf16 LSSA causal; fp16 LSSAR and bf16 LSSA not causal
# with a mask). Spills of the others, B on sm_80 / sm_90: at 128, 16x64 w4 s2: 0 / 120-288,
# one-grad 32x64 w4 s2: 0 / 8 and 32x128 w8 s2: 4 / 0 (fp16 mask); at 64, both gradients (not
# in the config list): 32x64 w4 s2: 16 / 0 (fp16 mask), 32x128 w8 s2: 24 / 0 (lssa mask).
# Since dq was fused into dk/dv (atomics by default; dq as k^T dS^T in these tiles),
# per precision: {precise (SPLIT): largest head dim}, remeasured on sm_90 (bf16, causal, lssa
# and lssar): one-grad 16x64 w4 s2 at 128 spilled 4-12 B with precise=True only; both
# gradients, 32 query rows (32x64 w4 s2, 32x128 w8 s2: new in the list) clean at 64 with
# precise=False (8-112 B with precise=True), kept only for launches with neither mask nor spans
# (PLAIN_WGMMA_DKDV: they spilled with masks before).
MEASURED_WGMMA_DKDV = {
    (16, 64, 4, 2, False): {False: 64, True: 64},
    (16, 64, 4, 2, True): {False: 128, True: 64},
    (32, 64, 4, 2, True): {False: 64, True: 64},
    (32, 128, 8, 2, True): {False: 64, True: 64},
    (32, 64, 4, 2, False): {False: 64, True: 0},  # precise: 8-112 B at 64
    (32, 128, 8, 2, False): {False: 64, True: 0},
}
PLAIN_WGMMA_DKDV = {(32, 64, 4, 2, False), (32, 128, 8, 2, False)}


def fits(
    kind: str,
    cfg: triton.Config,
    bd: int,
    bdv: int,
    ieee: bool,
    spans: bool = False,
    tf32: bool = False,
    mask: bool = False,
    arch: int | None = None,
    reweight: bool = True,
    split: bool = True,
    fold: bool = False,
) -> bool:
    """Whether ``cfg`` is expected to run without register spills within shared memory for a
    ``kind`` kernel ("fwd", "dq", "dkdv") at padded head dims ``bd``, ``bdv``; ``ieee``:
    fp32 inputs in IEEE fp32 (4-byte tiles, FMA dots); ``tf32``: fp32 inputs on TF32 tensor cores
    (``ieee`` False: 4-byte tiles, ``TF32_REG_BUDGET``); ``spans``, ``mask``: launched with key
    spans (``HAS_SPANS``), a mask (``HAS_MASK``), for ``MEASURED_SPILLS``; ``arch``: the target
    (``device_arch``; None: any), ``reweight`` (LSSAR), ``split`` (``precise``, hi + lo
    products), ``fold`` (the LSSAR forward for a backward, ``FOLD_F``). Key-major dk/dv tiles:
    where ``MEASURED_WGMMA_DKDV`` allows; the two-warpgroup row tiles (:data:`WGMMA_ROW_TILES`):
    where ``MEASURED_WGMMA_ROWS`` does."""
    bm, bn = cfg.kwargs["BM"], cfg.kwargs["BN"]
    w, st = cfg.num_warps, cfg.num_stages
    if (bm, bn, w, st) in WGMMA_ROW_TILES and kind != "dkdv":
        measured = MEASURED_WGMMA_ROWS.get((kind, bm, bn, w, st), frozenset())
        plain = not (ieee or tf32 or spans or mask)
        if plain and arch == 90 and (max(bd, bdv), reweight, split, fold) in measured:
            return True
        if (bm, bn) != (128, 32):  # the newer ones: only where measured
            return False
    if cfg.kwargs.get("KEY_MAJOR", False):
        key = (bm, bn, w, st, bool(cfg.kwargs["ONE_GRAD"]))
        if key in PLAIN_WGMMA_DKDV and (spans or mask):
            return False
        if not ieee and not tf32 and max(bd, bdv) > MEASURED_WGMMA_DKDV[key][split]:
            return False
    if _excluded(kind, cfg, bd, bdv, ieee, spans, tf32, mask, arch, fold and reweight):
        return False
    esize = 4 if ieee or tf32 else 2
    if _shared_bytes(kind, bm, bn, st, bd, bdv, esize) > SHARED_BUDGET:
        return False
    if cfg.kwargs.get("KEY_MAJOR", False):  # measured clean (_measured): no estimate needed
        return True
    if ieee:
        piped_ok = kind != "dkdv" or st == 1
        return piped_ok and bm * bn <= FMA_SCORES_PER_THREAD[kind] * 32 * w
    budget = TF32_REG_BUDGET if tf32 else REG_BUDGET
    return _cfg_words(kind, cfg, bd, bdv, esize, fold and reweight) <= budget[kind]


def _excluded(
    kind: str,
    cfg: triton.Config,
    bd: int,
    bdv: int,
    ieee: bool,
    spans: bool,
    tf32: bool,
    mask: bool,
    arch: int | None = None,
    fold: bool = False,
) -> bool:
    """Whether ``cfg`` is ruled out for the launch whatever the estimates say: it spilled in a
    measured launch like this one on this arch (:func:`_measured`), or it is a row tile with one
    score per thread (16x16, 8 warps), which is for fp32 on FMA units only (on tensor cores it
    leaves half the warps idle in every product)."""
    one_score = cfg.kwargs["BM"] * cfg.kwargs["BN"] < 64 * cfg.num_warps
    fma_only = not ieee and kind != "dkdv" and one_score
    return fma_only or _measured(kind, cfg, bd, bdv, ieee, spans, tf32, mask, arch, fold)


def _measured(
    kind: str,
    cfg: triton.Config,
    bd: int,
    bdv: int,
    ieee: bool,
    spans: bool,
    tf32: bool,
    mask: bool = False,
    arch: int | None = None,
    fold: bool = False,
) -> bool:
    """Whether ``cfg`` spilled in a measured launch like this one (``MEASURED_SPILLS``; the
    LSSAR training forward, ``fold``, also under "fwd-train") on ``arch`` (``SPILL_ARCHS``;
    None: on either); a key-major dk/dv tile: whether the launch is outside where it was
    measured clean (``MEASURED_WGMMA_DKDV``)."""
    tile = (cfg.kwargs["BM"], cfg.kwargs["BN"], cfg.num_warps, cfg.num_stages)
    if cfg.kwargs.get("KEY_MAJOR", False):
        limits = MEASURED_WGMMA_DKDV.get((*tile, bool(cfg.kwargs["ONE_GRAD"])), {})
        return ieee or tf32 or max(bd, bdv) > max(limits.values(), default=0)
    where = {SPANS} if spans else set()
    where |= {MASK} if mask else set()
    where = where or {PLAIN}

    def spilled(precision: str) -> frozenset[str]:
        hits = frozenset()
        for name in (kind, "fwd-train") if fold and kind == "fwd" else (kind,):
            key = (name, max(bd, bdv), precision, *tile)
            if arch is None or arch in SPILL_ARCHS.get(key, frozenset({arch})):
                hits |= MEASURED_SPILLS.get(key, frozenset())  # (else: the other arch only)
        return hits

    if ieee:
        hits = spilled("ieee")
    elif tf32:  # TF32 launches with spans or a mask were measured on their own: a half-precision
        # tile binds them only where it spilled in every kind of launch
        hits = spilled("tf32") | (ANYWHERE if spilled("half") == ANYWHERE else frozenset())
    else:
        hits = spilled("half")
    return not where.isdisjoint(hits)


def precision(named_args: dict, kwargs: dict) -> tuple[bool, bool]:
    """``(ieee, tf32)`` of a launch (its arguments as the autotuner passes them to the pruner):
    fp32 inputs in IEEE (``IEEE=True``), or fp32 inputs with ``IEEE=False``, i.e. on TF32 tensor
    cores (the host's choice from ``torch.backends.cuda.matmul.allow_tf32``)."""
    ieee = bool(kwargs["IEEE"])
    q = named_args.get("Q", kwargs.get("Q"))
    return ieee, not ieee and getattr(q, "dtype", None) == torch.float32


def _pruner(kind: str):
    """The autotuner's ``early_config_prune`` for a ``kind`` kernel: drops configs that would
    spill or not fit (:func:`fits`), unpipelined row tiles (``num_stages=1``) where a pipelined
    one fits, and row tiles taller than the query block (decoding, ``T_q = 1``: saves tuning
    time). Per target arch (:func:`device_arch`). Never returns an empty list: if nothing fits,
    the config with the fewest estimated live words."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list:
        bd, bdv = kwargs["BD"], kwargs["BDV"]
        ieee, tf32 = precision(named_args, kwargs)
        spans = bool(kwargs.get("HAS_SPANS", False))
        mask = bool(kwargs.get("HAS_MASK", False))
        arch = device_arch()
        launch = dict(
            arch=arch,
            reweight=bool(kwargs.get("REWEIGHT", True)),
            split=bool(kwargs.get("SPLIT", True)),
            fold=bool(kwargs.get("FOLD_F", False)),
        )
        kept = [c for c in configs if fits(kind, c, bd, bdv, ieee, spans, tf32, mask, **launch)]
        if kind != "dkdv":
            # unpipelined row tiles are a fallback, kept only where every pipelined one is pruned
            kept = [c for c in kept if c.num_stages > 1] or kept
            tq = named_args.get("tq_key", kwargs.get("tq_key", 1 << 30))
            short = [c for c in kept if c.kwargs["BM"] <= max(16, tq)]
            kept = short or kept[-1:]
        if not kept:  # the fewest live words, among the tiles not ruled out (_excluded) if any
            esize = 4 if ieee or tf32 else 2
            flags = (ieee, spans, tf32, mask, arch, launch["fold"] and launch["reweight"])
            pool = [c for c in configs if not _excluded(kind, c, bd, bdv, *flags)]
            kept = [min(pool or configs, key=lambda c: _cfg_words(kind, c, bd, bdv, esize))]
        return kept

    return prune


# Row-parallel kernels (forward, rows, dq): tall query tiles; key-parallel dk/dv: tall key tiles.
# Large tiles first (the autotuner weighs those that fit at the launch's head dim and dtype),
# then the small ones that fit at head dim 256 and with fp32 inputs (16x16 with 8 warps, one score
# per thread, for fp32 on FMA units only: _excluded), and last unpipelined ones for launches where
# every pipelined tile spills (fp32 rows at head dim 128 with key spans; TF32 at 256). On
# sm_90 a 64-row tile with 8 warps computes its element-wise work twice (both warpgroups hold the
# whole tile: twice the MUFU and ALU instructions per score in the SASS), so 64-row tiles with 4
# warps come first.
_ROW_CONFIGS = _configs(
    [
        (128, 64, 8, 2),
        (128, 128, 8, 2),
        (128, 32, 8, 2),
        (64, 64, 4, 2),
        (64, 32, 4, 2),
        (64, 64, 8, 3),
        (64, 64, 8, 2),
        (64, 32, 8, 2),
        (16, 64, 4, 2),
        (16, 32, 4, 2),
        (16, 16, 4, 2),
        (16, 16, 8, 2),
        (16, 16, 4, 1),
        (16, 16, 8, 1),
    ]
)
# dk/dv: query-major scores (q k^T, M = BM), both gradients per program; then the tiles for
# sm_90's wgmma (M % 64 == 0 per warpgroup in all four products, which no query-major LSSAR tile
# reaches without spilling: 64x64 with 4 or 8 warps, 24 B - 1.4 KB on sm_90): key-major scores
# (KEY_MAJOR: k q^T and v dO^T, M = BN = 64 per warpgroup, any BM), and one gradient per program
# (ONE_GRAD: dk and dv programs, one fp32 accumulator each, S recomputed by both), kept where
# MEASURED_WGMMA_DKDV says; see docs/history/RESULTS.md.
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
    ],
    KEY_MAJOR=False,
    ONE_GRAD=False,
)
_COL_CONFIGS += _configs(
    [(16, 64, 4, 2), (32, 64, 4, 2), (32, 128, 8, 2)],
    KEY_MAJOR=True,
    ONE_GRAD=False,
)
_COL_CONFIGS += _configs(
    [(16, 64, 4, 2), (32, 64, 4, 2), (32, 128, 8, 2)], KEY_MAJOR=True, ONE_GRAD=True
)


def _tuned(kernel, configs: list[triton.Config], kind: str):
    prune = {"early_config_prune": _pruner(kind)}
    key = _TUNE_KEY + [k for k in ("LOG_N", "FUSED_DQ") if k in kernel.arg_names]
    return triton.autotune(configs, key=key, prune_configs_by=prune)(kernel)


fwd_tuned = _tuned(fwd_kernel, _ROW_CONFIGS, "fwd")
# the backward's per-row kernel has no key loop: one small tile (no spill at head dim 256), no
# tuning
ROWS_CONFIG = triton.Config({"BM": 16}, num_warps=4, num_stages=1, maxnreg=MAXNREG)
rows_tuned = triton.autotune([ROWS_CONFIG], key=["BDV"])(bwd_rows_kernel)
dq_tuned = _tuned(bwd_dq_kernel, _ROW_CONFIGS, "dq")
dkdv_tuned = _tuned(bwd_dkdv_kernel, _COL_CONFIGS, "dkdv")
