"""GPU benchmark: LSSA / LSSAR (Triton, Flex) against SDPA's FlashAttention and Flex softmax.

Run on a CUDA machine from the repository root:

    python benchmarks/gpu.py                      # full sweep (tens of minutes: autotuning)
    python benchmarks/gpu.py --quick              # D=64, T=1K and 4K
    python benchmarks/gpu.py --lengths 4096 --head-dims 128 --skip-tests

First it runs the GPU-marked kernel tests (``pytest -m gpu tests/test_triton_kernels.py``) and
records their summary; then, for bf16, H=16 heads, causal attention, B*T ~= 16K tokens, every
(head dim, length) and every implementation, it measures forward and forward+backward with
``triton.testing.do_bench`` (median ms), the throughput in TFLOP/s and the peak extra memory.
The lssa / lssar rows call ``lssar.attention`` (``impl=``, and ``impl_options={"precise": False}``
for the "fast" rows), so they include the public function's argument checks.

FLOP convention (softmax-equivalent, as FlashAttention reports): forward = 4 B H T^2 D, halved
for causal; backward = 2.5x forward, so forward+backward = 3.5x forward. LSSAR does more work
(3 GEMMs forward, 7-9 backward); counting it as softmax keeps the TFLOP/s of every row comparable:
"x flash" (time of SDPA flash / time of the row, same run) is the number that matters.

Writes ``results.md`` (the tables, also printed), ``results.json``, ``env.json`` and
``gpu-tests.md`` into ``--out`` (default ``benchmarks/results-gpu/``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS = 16 * 1024
HEADS = 16
TARGETS = {  # x SDPA-flash throughput on H100/H200 the kernels aim for (not asserted)
    ("lssa triton", "fwd"): 0.85,
    ("lssar p=15 triton", "fwd"): 0.6,
    ("lssar p=15 triton", "fwd+bwd"): 0.55,
}


def _env(torch, triton) -> dict:
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_sha": sha or "unknown",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_gpu_tests(out: Path) -> int:
    """``pytest -m gpu tests/test_triton_kernels.py``; its summary goes to ``gpu-tests.md``."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider"]
    cmd.append("tests/test_triton_kernels.py")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    body = "\n".join(lines[-60:])
    text = (
        f"# GPU kernel tests\n\n`{' '.join(cmd[1:])}` -> exit code {proc.returncode} "
        f"in {time.time() - t0:.0f} s\n\n```\n{body}\n```\n"
    )
    (out / "gpu-tests.md").write_text(text)
    print(text)
    return proc.returncode


def _cases(torch) -> list[tuple[str, Callable]]:
    """``(label, make)``: ``make(q, k, v)`` returns the attention callable for those inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_flash(q, k, v):
        def f():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return f

    cases = [("softmax SDPA flash", sdpa_flash)]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)

        def flex_softmax(q, k, v):
            t = q.shape[2]
            bm = create_block_mask(
                lambda b, h, i, j: j <= i, None, None, t, t, device=q.device, _compile=True
            )
            return lambda: compiled(q, k, v, block_mask=bm)

        cases.append(("softmax flex", flex_softmax))
    except ImportError:
        pass

    import lssar
    from lssar.ops.registry import IMPLS

    def lssar_impl(impl, name, p, **impl_options):
        options = {} if p is None else {"p": p}

        def make(q, k, v):
            return lambda: lssar.attention(
                q, k, v, is_causal=True, variant=name, impl=impl,
                impl_options=impl_options or None, **options,
            )  # fmt: skip

        return make

    if "triton" in IMPLS:
        cases += [
            ("lssa triton", lssar_impl("triton", "lssa", None)),
            ("lssar p=15 triton", lssar_impl("triton", "lssar", 15.0)),
            ("lssar p=3 triton", lssar_impl("triton", "lssar", 3.0)),
            # FlashAttention-style rounding of the weights (one MMA per product, not two)
            ("lssa triton fast", lssar_impl("triton", "lssa", None, precise=False)),
            ("lssar p=15 triton fast", lssar_impl("triton", "lssar", 15.0, precise=False)),
        ]
    else:
        print("skipping the Triton impl: triton is not installed", file=sys.stderr)
    if "flex" in IMPLS:
        cases += [
            ("lssa flex", lssar_impl("flex", "lssa", None)),
            ("lssar p=15 flex", lssar_impl("flex", "lssar", 15.0)),
        ]
    return cases


def measure(torch, triton, make, b: int, t: int, d: int, mode: str) -> dict:
    """Median ms and peak extra MiB of one forward (+ backward) on fresh bf16 inputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (b, HEADS, t, d)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(
            mode == "fwd+bwd"
        )
        for _ in range(3)
    )
    fn = make(q, k, v)
    if mode == "fwd":

        def step():
            with torch.no_grad():
                return fn()
    else:
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

        def step():
            fn().backward(grad)

    step()  # compile / autotune outside the timed and measured region
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(step, grad_to_none=[q, k, v], return_mode="median")
    return {"ms": ms, "peak_mib": peak}


def flops(b: int, t: int, d: int, mode: str) -> float:
    fwd = 4.0 * b * HEADS * t * t * d / 2  # causal: half the score matrix
    return fwd if mode == "fwd" else 3.5 * fwd


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def tables(rows: list[dict], env: dict) -> str:
    """Markdown: one long table, then the 'x SDPA flash' summary with the targets."""
    out = [
        f"# Attention on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, "
        f"git {env['git_sha'][:10]})",
        "",
        f"bf16, causal, H={HEADS}, B*T={TOKENS} tokens. TFLOP/s in the softmax-equivalent "
        "convention (forward 4BHT^2D/2, forward+backward 3.5x that) for every row; "
        "'x flash' = SDPA-flash time / row time, same run (higher is better).",
        "",
        "| D | T | B | mode | impl | median ms | TFLOP/s | x flash | peak MiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['d']} | {r['t']} | {r['b']} | {r['mode']} | {r['impl']} | "
            f"{_fmt(r.get('ms'), '.3f')} | {_fmt(r.get('tflops'), '.1f')} | "
            f"{_fmt(r.get('x_flash'), '.2f')} | {_fmt(r.get('peak_mib'), '.0f')} | "
            f"{r.get('error', '').replace('|', '/')} |"
        )
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    keys = sorted({(r["d"], r["mode"]) for r in rows}, key=lambda x: (x[1], x[0]))
    lengths = sorted({r["t"] for r in rows})
    for d, mode in keys:
        out += ["", f"## x SDPA flash, D={d}, {mode}", ""]
        out.append("| impl | " + " | ".join(f"T={t}" for t in lengths) + " | target |")
        out.append("|---" * (len(lengths) + 2) + "|")
        for impl in impls:
            cells = []
            for t in lengths:
                hit = [
                    r for r in rows if (r["d"], r["mode"], r["t"], r["impl"]) == (d, mode, t, impl)
                ]
                cells.append(_fmt(hit[0].get("x_flash") if hit else None, ".2f"))
            target = TARGETS.get((impl, mode))
            out.append(f"| {impl} | " + " | ".join(cells) + f" | {_fmt(target, '.2f')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results-gpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--impls", nargs="*", help="substrings selecting implementations")
    ap.add_argument("--quick", action="store_true", help="D=64, T=1K and 4K")
    ap.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "nothing was run. For CPU timings use benchmarks/attention.py.",
            file=sys.stderr,
        )
        return 2
    import triton
    import triton.testing  # noqa: F401  (do_bench)

    # one compiled flex_attention entry per (shape, score_mod): the default limit of 8 would
    # silently drop the later lengths to the unfused eager path
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    if args.quick:
        args.lengths, args.head_dims = [1024, 4096], [64]
    args.out.mkdir(parents=True, exist_ok=True)
    env = _env(torch, triton)
    (args.out / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    tests_rc = None if args.skip_tests else run_gpu_tests(args.out)

    cases = _cases(torch)
    if args.impls:
        cases = [
            c for c in cases if c[0] == "softmax SDPA flash" or any(s in c[0] for s in args.impls)
        ]
    rows: list[dict] = []
    for d in args.head_dims:
        for t in args.lengths:
            b = max(1, TOKENS // t)
            for mode in args.modes:
                base = None
                for label, make in cases:
                    row = {"d": d, "t": t, "b": b, "mode": mode, "impl": label}
                    try:
                        row.update(measure(torch, triton, make, b, t, d, mode))
                        row["tflops"] = flops(b, t, d, mode) / (row["ms"] * 1e-3) / 1e12
                        if label == "softmax SDPA flash":
                            base = row["ms"]
                        row["x_flash"] = base / row["ms"] if base else None
                    except Exception as e:  # one failing impl must not end the sweep
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    finally:
                        torch.cuda.empty_cache()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    md = tables(rows, env)
    if tests_rc is not None:
        md += f"\nGPU kernel tests: exit code {tests_rc} (see gpu-tests.md).\n"
    (args.out / "results.md").write_text(md)
    (args.out / "results.json").write_text(
        json.dumps({"env": env, "tests_exit_code": tests_rc, "rows": rows}, indent=2) + "\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
