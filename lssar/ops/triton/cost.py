"""Static cost of the Triton kernels' inner loops, beside a FlashAttention-2-style softmax kernel.

``python -m lssar.ops.triton.cost [--head-dim 128] [--dtype bf16] [--arch 90]``

An estimate from the SASS, not a measurement: each kernel is compiled as in
:mod:`lssar.ops.triton.compile_check` (same launch recording, same specialisation), the
instructions inside its innermost loops (one iteration = one ``BM x BN`` tile of scores; the
LSSAR forward has two such loops, both run over every tile) are counted by class, and the counts
are scaled to one score element: ``count x 32 x num_warps / (BM x BN)`` (thread-instructions per
element). Every instruction is counted once, whether or not a branch skips it, and latency,
dual issue, memory stalls and occupancy are ignored. The reference is :func:`fa2_softmax_fwd`, a
minimal FlashAttention-2 forward (online softmax with ``exp2``, one ``P V`` product) compiled
for the same tile, dtype and arch; each kernel's ratio is to that kernel in the same tile.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
import triton.language as tl

from lssar.ops.triton import compile_check as cc
from lssar.ops.triton.autotune import MAXNREG


@triton.jit
def fa2_softmax_fwd(
    Q, K, V, O, sqt, skt, svt, sot, Tq, Tk, off, qk_scale,
    BD: tl.constexpr, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # The reference point only (never launched by the library): FlashAttention-2's forward loop
    # (scores, running max, exp2, rescale, P V), with the same visibility masks and causal block
    # limit as fwd_kernel so that the two loops differ only in the weight function.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    q = tl.load(Q + pid_bh * Tq * sqt + offs_m[:, None] * sqt + offs_d[None, :])
    Kb = K + pid_bh * Tk * skt
    Vb = V + pid_bh * Tk * svt
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(Tk, off + (pid_m + 1) * BM)
    for start_n in range(0, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        kmask = offs_n < Tk
        k = tl.load(Kb + offs_n[:, None] * skt + offs_d[None, :], mask=kmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # log2-domain scores
        vis = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None] + off)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vb + offs_n[:, None] * svt + offs_d[None, :], mask=kmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        O + pid_bh * Tq * sot + offs_m[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty)
    )


COLUMNS = ("total", "ex2", "lg2", "rcp", "tensor", "local")


def _fa2_build(head_dim: int, dtype: str, causal: bool, cfg: triton.Config, arch: int) -> cc.Build:
    t = cc.SEQ_LEN
    q = torch.zeros(cc.BATCH * cc.HEADS, t, head_dim, dtype=cc._DTYPES[dtype])
    args = (q, q, q, q, head_dim, head_dim, head_dim, head_dim, t, t, 0, 1.0)
    kw = {"BD": head_dim, "CAUSAL": causal, **cfg.all_kwargs()}
    sig, cst, attrs, opts = cc.specialise(fa2_softmax_fwd, args, kw, arch)
    case = cc.Case(head_dim, dtype, causal, "softmax", False)
    return cc.Build(
        case, "fa2", cc._config_label(cfg), arch, True, __name__, "fa2_softmax_fwd",
        sig, cst, attrs, opts, cc._cache_key(fa2_softmax_fwd, sig, cst, attrs, opts, arch),
    )  # fmt: skip


def _per_element(row: dict) -> dict[str, float]:
    bm, bn = (int(x) for x in row["config"].split()[0].split("x"))
    warps = int(row["config"].split()[1][1:])
    scale = 32 * warps / (bm * bn)
    lp = row["loop"]
    counts = {**lp, "tensor": lp["hgmma"] + lp["hmma"]}
    return {c: counts[c] * scale for c in COLUMNS}


@dataclasses.dataclass
class CostRow:
    """One kernel's per-element counts, its tile, and its total's ratio to the FA2 forward."""

    name: str
    config: str
    loops: int
    per_element: dict[str, float]
    ratio: float


def cost_table(head_dim: int = 128, dtype: str = "bf16", arch: int = 90, jobs: int = 2) -> list:
    """Per-element inner-loop counts of every kernel the host launches for lssa and lssar (causal,
    no mask), each in the first config its autotuner keeps, and of the FA2-style forward compiled
    in each of those tiles (with the same register bound, ``MAXNREG``): a kernel's ratio is to
    the FA2 forward in its own tile (a tile whose MMA layout replicates work across warps costs
    both the same)."""
    blds = []
    for variant in ("lssa", "lssar"):
        case = cc.Case(head_dim, dtype, True, variant, False)
        seen = set()
        for b in cc.builds([case], (arch,), kept_only=True):
            if b.kernel not in seen:  # the first kept config of each kernel
                seen.add(b.kernel)
                blds.append(b)
    fa2 = {}
    for b in blds:
        if _tile(b.config) not in fa2:
            bm, bn = (int(x) for x in b.config.split()[0].split("x"))
            warps, stages = (int(x[1:]) for x in b.config.split()[1:3])
            cfg = triton.Config(
                {"BM": bm, "BN": bn}, num_warps=warps, num_stages=stages, maxnreg=MAXNREG
            )
            fa2[_tile(b.config)] = _fa2_build(head_dim, dtype, True, cfg, arch)
    rows = cc.run(blds + list(fa2.values()), jobs)
    bad = [f"{r['case']} {r['kernel']}: {r['error']}" for r in rows if not r["ok"]]
    if bad:
        raise RuntimeError("; ".join(bad))
    base = {r["config"]: _per_element(r)["total"] for r in rows if r["kernel"] == "fa2"}
    out = []
    for r in rows:
        if r["loop"]["loops"] == 0:  # the LSSA rows kernel: one vector op per row, no key loop
            continue
        pe = _per_element(r)
        name = "FA2-style softmax fwd" if r["kernel"] == "fa2" else f"{r['variant']} {r['kernel']}"
        ratio = pe["total"] / base[_tile(r["config"])]
        out.append(CostRow(name, r["config"], r["loop"]["loops"], pe, ratio))
    return out


def _tile(config: str) -> str:
    # "BMxBN wW sS" of a config label (without the dk/dv formulation's flags)
    return " ".join(config.split()[:3])


def markdown(rows: list[CostRow]) -> str:
    """The table as Markdown."""
    head = (
        "| kernel | tile | loops | total | MUFU.EX2 | MUFU.LG2 | MUFU.RCP | MMA | STL+LDL "
        "| ratio to FA2 (same tile) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pe = r.per_element
        lines.append(
            f"| {r.name} | {r.config} | {r.loops} | {pe['total']:.1f} | {pe['ex2']:.2f} | "
            f"{pe['lg2']:.2f} | {pe['rcp']:.2f} | {pe['tensor']:.3f} | {pe['local']:.2f} | "
            f"{r.ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: print the table."""
    ap = argparse.ArgumentParser(prog="python -m lssar.ops.triton.cost")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    ap.add_argument("--dtype", default="bf16", choices=tuple(cc._DTYPES))
    ap.add_argument("--arch", type=int, default=90, choices=cc.ARCHS)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    print(markdown(cost_table(a.head_dim, a.dtype, a.arch, a.jobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
