"""Attention benchmark: every variant x implementation x length, side by side with SDPA softmax.

For each (variant, impl, T, dtype): forward time, forward+backward time and peak extra memory
(resident set growth, Linux ``VmHWM`` reset per measurement), with the ratio to SDPA softmax
measured in the same run. Prints a Markdown table and the machine, threads and torch version.

    python benchmarks/attention.py                 # full grid: T = 1K..16K, fp32 and bf16
    python benchmarks/attention.py --quick         # T = 1K, 2K, fp32 (a minute)
    python benchmarks/attention.py --lengths 4096 --dtypes fp32 --out table.md

The materialised reference is skipped where its T x T buffers would not fit (``--ref-max-t``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import lssar

CASES = [  # (label, variant, impl)
    ("softmax (SDPA)", "softmax", "sdpa"),
    ("lssa cpu (fused C++)", "lssa", "cpu"),
    ("lssar p=15 cpu (fused C++)", "lssar", "cpu"),
    ("lssa chunked", "lssa", "chunked"),
    ("lssar p=15 chunked", "lssar", "chunked"),
    ("lssa reference", "lssa", "reference"),
    ("lssar p=15 reference", "lssar", "reference"),
    ("softmax-qknorm-logn (SDPA)", "softmax-qknorm-logn", "sdpa"),
]
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


def measure(fn, repeats: int) -> tuple[float, float]:
    """(median seconds, peak extra MiB) of ``fn()`` after one warm-up call."""
    fn()
    times = []
    base = _reset_peak()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    peak = (_rss_kib("VmHWM:") - base) / 1024
    return statistics.median(times), max(peak, 0.0)


def run_case(
    variant: str, impl: str, t: int, dtype: torch.dtype, repeats: int, b: int, h: int, d: int
) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(dtype) for _ in range(3))

    def fwd():
        with torch.no_grad():
            lssar.attention(q, k, v, is_causal=True, variant=variant, impl=impl)

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def fwd_bwd():
        out = lssar.attention(qg, kg, vg, is_causal=True, variant=variant, impl=impl)
        out.backward(torch.ones_like(out))
        qg.grad = kg.grad = vg.grad = None

    tf, mf = measure(fwd, repeats)
    tb, mb = measure(fwd_bwd, repeats)
    return {"fwd_s": tf, "fwd_mib": mf, "fwdbwd_s": tb, "fwdbwd_mib": mb}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}; {os.cpu_count()} cores; torch {torch.__version__}; "
        f"threads {torch.get_num_threads()}; python {sys.version.split()[0]}"
    )


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
    ap.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.dtypes, args.repeats = [1024, 2048], ["fp32"], 2

    header = (
        f"B={args.batch} H={args.heads} D={args.head_dim}, causal. Times are medians of "
        f"{args.repeats}; memory = peak resident growth; ratio = time / SDPA softmax time "
        "in the same run and dtype.\n\nMachine: " + machine()
    )
    rows = [
        "| dtype | T | attention | fwd ms | fwd x SDPA | fwd+bwd ms | fwd+bwd x SDPA | "
        "fwd MiB | fwd+bwd MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print(header, flush=True)
    for dname in args.dtypes:
        for t in args.lengths:
            base = None
            for label, variant, impl in CASES:
                if impl == "reference" and t > args.ref_max_t:
                    continue
                r = run_case(
                    variant,
                    impl,
                    t,
                    DTYPES[dname],
                    args.repeats,
                    args.batch,
                    args.heads,
                    args.head_dim,
                )
                base = base or r
                rows.append(
                    f"| {dname} | {t} | {label} | {r['fwd_s'] * 1e3:.1f} | "
                    f"{r['fwd_s'] / base['fwd_s']:.2f} | {r['fwdbwd_s'] * 1e3:.1f} | "
                    f"{r['fwdbwd_s'] / base['fwdbwd_s']:.2f} | {r['fwd_mib']:.0f} | "
                    f"{r['fwdbwd_mib']:.0f} |"
                )
                print(rows[-1], flush=True)
    table = header + "\n\n" + "\n".join(rows) + "\n"
    if args.out:
        args.out.write_text(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
