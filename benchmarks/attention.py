"""Attention benchmark: every variant x implementation x length, side by side with SDPA softmax.

For each (variant, impl, T, dtype): forward time, forward+backward time and peak extra memory
(resident set growth, Linux ``VmHWM`` reset per measurement), with the ratio to SDPA softmax
measured in the same run; the cases are interleaved round by round, so a slow spell of a shared
machine hits them alike. A last row times SDPA's GEMMs alone, as BLAS tiles (no element-wise work).
``--clock cpu`` times with the process's CPU time instead of the wall clock: on a machine
shared with other jobs (time slices taken away, not work added) it is the steadier measure with
one thread; with more it sums the threads' time (the work, not the latency).
The ALiBi rows (``+alibi``: softmax with ALiBi's bias, the standard slopes of H heads) show what
the SDPA path's query blocks cost against plain SDPA softmax and the materialised reference. The
packed rows (documents of 512 tokens, ``cu_seqlens``) and window rows (512 keys, ``window=(511,
0)``) show the block-skipping paths: their time and memory grow as T x 512, not T^2.
Prints a Markdown table and the machine, threads and torch version.

    python benchmarks/attention.py                 # full grid: T = 1K..16K, fp32 and bf16
    python benchmarks/attention.py --quick         # T = 1K, 2K, fp32 (a minute)
    python benchmarks/attention.py --lengths 4096 --dtypes fp32 --out table.md
    python benchmarks/attention.py --threads 1     # one core: steadier ratios on a busy VM
    python benchmarks/attention.py --threads 1 --clock cpu --lengths 4096 --repeats 7
    python benchmarks/attention.py --cases ALiBi --lengths 4096 16384   # SDPA + the ALiBi rows
    python benchmarks/attention.py --cases packed window --lengths 4096 16384 --dtypes fp32

The materialised reference is skipped where its T x T buffers would not fit (``--ref-max-t``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import lssar
from lssar.ops import chunked
from lssar.ops.cpu.build import build_isa, kernel
from lssar.positions import alibi_slopes
from lssar.runio import cpu_info

CASES = [  # (label, variant, impl); the first is the baseline of the ratios
    ("softmax (SDPA)", "softmax", "sdpa"),
    ("lssa cpu (fused C++)", "lssa", "cpu"),
    ("lssar p=15 cpu (fused C++)", "lssar", "cpu"),
    ("lssa chunked", "lssa", "chunked"),
    ("lssar p=15 chunked", "lssar", "chunked"),
    ("lssa reference", "lssa", "reference"),
    ("lssar p=15 reference", "lssar", "reference"),
    ("softmax-qknorm-logn (SDPA)", "softmax-qknorm-logn", "sdpa"),
    ("softmax + ALiBi (SDPA, query blocks)", "softmax", "sdpa+alibi"),
    ("softmax + ALiBi reference", "softmax", "reference+alibi"),
    # packed documents (cu_seqlens) and a sliding window, O(T * W) work and memory
    ("softmax (SDPA), packed docs of 512", "softmax", "sdpa+packed"),
    ("lssar p=15 cpu, packed docs of 512", "lssar", "cpu+packed"),
    ("lssar p=15 chunked, packed docs of 512", "lssar", "chunked+packed"),
    ("softmax (SDPA), window 512", "softmax", "sdpa+window"),
    ("lssar p=15 cpu, window 512", "lssar", "cpu+window"),
    ("lssar p=15 chunked, window 512", "lssar", "chunked+window"),
    ("QK^T and PV GEMMs only (BLAS tiles)", None, "gemm"),
]
SPAN = 512  # the packed rows' document length and the window's keys
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Free what can be freed, reset the peak RSS counter, return the current RSS (KiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_kib("VmRSS:")


def peak_mib(fn) -> float:
    """Peak extra resident memory (MiB) of one call of ``fn()``."""
    base = _reset_peak()
    fn()
    return max((_rss_kib("VmHWM:") - base) / 1024, 0.0)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter  # set from --clock


def seconds(fn) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def blas_gemms(q, k, v, rows: int = 256, keys: int = 512) -> None:
    """The GEMMs alone as BLAS computes them in tiles of 256 query rows x 512 keys (causal
    blocks), as SDPA's CPU flash kernel does: per tile S = Q K^T, then O += S V, into
    preallocated buffers, nothing element-wise. The fused kernel computes its products with its
    own micro-kernels (no per-tile packing), so this is SDPA's GEMM time, not a floor of it."""
    t, dv = q.shape[-2], v.shape[-1]
    sbuf, obuf = q.new_empty(rows * keys), q.new_empty(rows * dv)
    for qh, kh, vh in zip(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)):
        for i0 in range(0, t, rows):
            i1 = min(t, i0 + rows)
            o = obuf[: (i1 - i0) * dv].view(i1 - i0, dv).zero_()
            for k0 in range(0, i1, keys):
                k1 = min(i1, k0 + keys)
                s = sbuf[: (i1 - i0) * (k1 - k0)].view(i1 - i0, k1 - k0)
                o.addmm_(torch.mm(qh[i0:i1], kh[k0:k1].t(), out=s), vh[k0:k1])


def case_fns(variant: str, impl: str, q, k, v):
    """(forward, forward+backward) callables for one case on shared inputs."""
    if impl == "gemm":
        return (lambda: blas_gemms(q, k, v)), None
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    impl, _, extra = impl.partition("+")
    t = q.shape[2]
    kw = {
        "alibi": {"alibi_slopes": alibi_slopes(q.shape[1])},
        # documents of SPAN tokens (the last one shorter)
        "packed": {"cu_seqlens": torch.tensor([*range(0, t, SPAN), t], dtype=torch.int32)},
        "window": {"window": (SPAN - 1, 0)},
        "": {},
    }[extra]

    def fwd():
        with torch.no_grad():
            lssar.attention(q, k, v, is_causal=True, variant=variant, impl=impl, **kw)

    def fwd_bwd():
        out = lssar.attention(qg, kg, vg, is_causal=True, variant=variant, impl=impl, **kw)
        out.backward(torch.ones_like(out))
        qg.grad = kg.grad = vg.grad = None

    return fwd, fwd_bwd


def run_length(cases, t: int, dtype: torch.dtype, args) -> dict[str, dict]:
    """Every case at one length and dtype: one warm-up call each, then ``repeats`` rounds in
    which every case runs once (so a slow spell of the machine hits every case alike); the
    median per case, and the peak memory of one more call."""
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, t, args.head_dim)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(3))
    fns = {label: case_fns(variant, impl, q, k, v) for label, variant, impl in cases}
    times: dict[str, tuple[list, list]] = {label: ([], []) for label in fns}
    for fwd, bwd in fns.values():
        fwd()
        if bwd:
            bwd()
    for _ in range(args.repeats):
        for label, (fwd, bwd) in fns.items():
            times[label][0].append(seconds(fwd))
            if bwd:
                times[label][1].append(seconds(bwd))
    out = {}
    for label, (fwd, bwd) in fns.items():
        tf, tb = times[label]
        out[label] = {
            "fwd_s": statistics.median(tf),
            "fwd_mib": peak_mib(fwd),
            "fwdbwd_s": statistics.median(tb) if tb else None,
            "fwdbwd_mib": peak_mib(bwd) if bwd else None,
        }
    return out


# the CPU flags the numbers depend on: vector ISA, native bf16 / fp16 (AVX-512 BF16, AMX)
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def machine() -> str:
    """CPU model, cores, the flags of :data:`FLAGS` it has, vector ISA torch runs and the one
    the kernel is built for, torch version, threads, clock, python."""
    info = cpu_info()
    cpu, flags = info["cpu_model"], set(info["cpu_flags"].split())
    mod = kernel()
    dot = mod is not None and hasattr(mod, "bf16_dot") and mod.bf16_dot() and chunked.BF16_DOT
    return (
        f"{cpu}; {os.cpu_count()} cores; flags {' '.join(f for f in FLAGS if f in flags) or '?'}"
        f"; {torch.backends.cpu.get_cpu_capability()} "
        f"(cpu kernel built for {build_isa() or 'portable code'}; bf16 inputs' Q K^T on "
        f"{'AVX512-BF16 dot products' if dot else 'float32 copies'}); "
        f"torch {torch.__version__}; threads {torch.get_num_threads()}; "
        f"clock {'cpu' if clock is time.process_time else 'wall'}; python {sys.version.split()[0]}"
    )


def set_clock(name: str) -> None:
    """Time with ``name`` (:data:`CLOCKS`) from now on."""
    global clock
    clock = CLOCKS[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 1K, 2K in fp32 only")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument(
        "--ref-max-t",
        type=int,
        default=4096,
        help="largest T for the materialised reference (memory is O(T^2))",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--clock", choices=list(CLOCKS), default="wall", help="wall time or process CPU time"
    )
    ap.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    ap.add_argument(
        "--cases",
        nargs="+",
        help="only the cases whose label contains one of these (SDPA softmax, the baseline, "
        "always runs)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    set_clock(args.clock)
    if args.quick:
        args.lengths, args.dtypes, args.repeats = [1024, 2048], ["fp32"], 2

    header = (
        f"B={args.batch} H={args.heads} D={args.head_dim}, causal. Times are medians of "
        f"{args.repeats} rounds, every case once per round; memory = peak resident growth of "
        "one call; ratio = time / SDPA softmax time in the same run and dtype. The BLAS tiles row "
        "times QK^T and PV alone as SDPA computes them (256 rows x 512 keys)."
        "\n\nMachine: " + machine()
    )
    rows = [
        "| dtype | T | attention | fwd ms | fwd x SDPA | fwd+bwd ms | fwd+bwd x SDPA | "
        "fwd MiB | fwd+bwd MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print(header, flush=True)
    for dname in args.dtypes:
        for t in args.lengths:
            cases = [c for c in CASES if not c[2].startswith("reference") or t <= args.ref_max_t]
            if args.cases:
                cases = cases[:1] + [c for c in cases[1:] if any(w in c[0] for w in args.cases)]
            results = run_length(cases, t, DTYPES[dname], args)
            base = results[cases[0][0]]
            for label, r in results.items():
                bwd = "| - | - |"
                if r["fwdbwd_s"] is not None:
                    bwd = f"| {r['fwdbwd_s'] * 1e3:.1f} | {r['fwdbwd_s'] / base['fwdbwd_s']:.2f} |"
                rows.append(
                    f"| {dname} | {t} | {label} | {r['fwd_s'] * 1e3:.1f} | "
                    f"{r['fwd_s'] / base['fwd_s']:.2f} {bwd} {r['fwd_mib']:.0f} | "
                    + ("- |" if r["fwdbwd_mib"] is None else f"{r['fwdbwd_mib']:.0f} |")
                )
                print(rows[-1], flush=True)
    table = header + "\n\n" + "\n".join(rows) + "\n"
    if args.out:
        args.out.write_text(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
