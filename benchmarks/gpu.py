"""GPU benchmark: LSSA / LSSAR (Triton, Flex) against softmax (SDPA flash and cuDNN, Flex, and the
static cost model's FA2-style Triton reference), prefill and decode, in one run.

Run on a CUDA machine from the repository root:

    python benchmarks/gpu.py                      # everything (see --dry-run for the plan)
    python benchmarks/gpu.py --quick              # D=128, T=4K, decode at 16K keys, the main rows
    python benchmarks/gpu.py --dry-run            # the plan and its time estimate, no GPU needed
    python benchmarks/gpu.py --lengths 4096 --head-dims 128 --skip-tests --no-decode

First it runs the GPU-marked kernel tests (``pytest -m gpu tests/ops/test_triton_kernels.py``) and
records their summary. Prefill: bf16, H=16 heads, causal, B*T ~= 16K tokens, every (head dim,
length, mode) and implementation: forward and forward+backward times from
``triton.testing.do_bench`` (median ms), TFLOP/s, peak extra memory, and for the Triton rows the
RMS error of the output against ``impl="chunked"`` in fp32 (same inputs). Decode: one step of
one query per head (G query heads per kv head, bf16), its time, the K/V bytes it must read per
second (GB/s) and its speed relative to SDPA softmax. The lssa / lssar rows call
``lssar.attention`` (``impl=``, ``impl_options``), so they include the public function's checks.

FLOP convention (softmax-equivalent, as FlashAttention reports): forward = 4 B H T^2 D, halved
for causal; backward = 2.5x forward, so forward+backward = 3.5x forward. "x flash" is SDPA
flash's time over the row's (same run; FlashAttention-2 in torch 2.13); "x FA2-style" the same
against the cost model's own Triton reference (``lssar.ops.triton.devtools.cost``), the unit the
projection uses (docs/gpu-kernels.md): the measured and the projected numbers are then directly
comparable. The autotuner's pick per kernel is saved (``results.json``: ``autotune``).

Writes ``results.md`` (the tables, also printed), ``results.json``, ``env.json`` and
``gpu-tests.md`` into ``--out`` (default ``benchmarks/results-gpu/``). How long it takes:
``--dry-run`` prints the estimate (cells x seconds per cell, plus the autotuning of each
kernel's configs); the run prints its progress and writes the elapsed time.
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
DECODE_HEADS, DECODE_GROUP = 32, 4  # query heads, query heads per kv head (8 kv heads)
# Estimates for --dry-run (not measured on a device: the sessions that wrote this had none):
# seconds per timed cell (warm-up, do_bench's ~100 ms of repeats, the chunked check) and per
# autotuned (kernel, key) pair (Triton compiles each kept config once, then times them)
SECONDS_PER_CELL = 3.0
SECONDS_PER_AUTOTUNE = 20.0
QUICK = ["SDPA", "FA2-style", "lssa triton fast", "lssar p=15 triton"]  # --quick's rows
TARGETS = {  # the projection's targets, x FA2-style (the projection's unit; not asserted)
    ("lssa triton fast", "fwd"): 0.9,
    ("lssar p=15 triton fast", "fwd"): 0.55,
    ("lssar p=15 triton fast", "fwd+bwd"): 0.5,
}


def _env(torch, triton) -> dict:
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_sha": sha or "unknown",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_gpu_tests(out: Path) -> int:
    """``pytest -m gpu tests/ops/test_triton_kernels.py``; its summary goes to ``gpu-tests.md``."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider"]
    cmd.append("tests/ops/test_triton_kernels.py")
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


# ----------------------------------------------------------------------------- implementations

PREFILL = [
    "softmax SDPA flash",
    "softmax SDPA cuDNN",
    "softmax flex",
    "softmax FA2-style (cost model's reference)",
    "lssa triton",
    "lssa triton fast",
    "lssar p=15 triton",
    "lssar p=15 triton fast",
    "lssar p=15 triton fast deterministic",
    "lssar p=3 triton fast",
    "lssa flex",
    "lssar p=15 flex",
]
DECODE = [
    "softmax SDPA",
    "softmax flex",
    "lssa triton",
    "lssar p=15 triton fast",
    "lssar p=15 triton",
]


def _fa2_reference(torch, triton):
    """The cost model's FA2-style softmax (``lssar.ops.triton.devtools.cost``): forward and
    backward kernels, autotuned over their candidate tiles; ``make(q, k, v)`` as the other
    cases'. A timing reference: the loops the static model counts (its gradients are not
    checked)."""
    from lssar.ops.triton.devtools import cost as C

    def tuned(kind, key):
        cfgs = [
            triton.Config({"BM": m, "BN": n}, num_warps=w, num_stages=s)
            for m, n, w, s in C.FA2_TILES[kind]
        ]
        return triton.autotune(cfgs, key=key)(C._FA2_KERNELS[kind])

    fwd_k, dkdv_k, dq_k = (tuned(kind, ["T", "BD"]) for kind in ("fwd", "dkdv", "dq"))

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            bh, t, d = q.shape
            o = torch.empty_like(q)
            lse = torch.empty(bh, t, device=q.device, dtype=torch.float32)
            scale = 1.4426950408889634 / math.sqrt(d)
            fwd_k[lambda m: (t // m["BM"], bh)](q, k, v, o, lse, d, d, d, d, t, scale, BD=d)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            bh, t, d = q.shape
            do = do.contiguous()
            delta = (do.float() * o.float()).sum(-1)
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
            dkdv_k[lambda m: (t // m["BN"], bh)](q, k, v, do, lse, delta, dk, dv, d, t, BD=d)
            dq_k[lambda m: (t // m["BM"], bh)](q, k, v, do, lse, delta, dq, d, t, BD=d)
            return dq, dk, dv

    def make(q, k, v):
        b, h, t, d = q.shape
        qf, kf, vf = (x.reshape(b * h, t, d) for x in (q, k, v))
        return lambda: Fn.apply(qf, kf, vf).view(b, h, t, d)

    return make


def _cases(torch, wanted: list[str]) -> list[tuple[str, Callable]]:
    """``(label, make)`` for the prefill labels in ``wanted`` that this machine can run:
    ``make(q, k, v)`` returns the attention callable for those inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import lssar
    from lssar.ops import IMPLS

    def sdpa(backend):
        def make(q, k, v):
            def f():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            return f

        return make

    def flex_softmax():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)

        def make(q, k, v):
            t = q.shape[2]
            bm = create_block_mask(
                lambda b, h, i, j: j <= i, None, None, t, t, device=q.device, _compile=True
            )
            return lambda: compiled(q, k, v, block_mask=bm)

        return make

    def impl(name, variant, p, **impl_options):
        options = {} if p is None else {"p": p}

        def make(q, k, v):
            return lambda: lssar.attention(
                q, k, v, is_causal=True, variant=variant, impl=name,
                impl_options=impl_options or None, **options,
            )  # fmt: skip

        return make

    builders = {
        "softmax SDPA flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
        "softmax SDPA cuDNN": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
        "softmax flex": flex_softmax,
        "softmax FA2-style (cost model's reference)": lambda: _fa2_reference(torch, _triton()),
        "lssa triton": lambda: impl("triton", "lssa", None),
        "lssa triton fast": lambda: impl("triton", "lssa", None, precise=False),
        "lssar p=15 triton": lambda: impl("triton", "lssar", 15.0),
        "lssar p=15 triton fast": lambda: impl("triton", "lssar", 15.0, precise=False),
        "lssar p=15 triton fast deterministic": lambda: impl(
            "triton", "lssar", 15.0, precise=False, deterministic=True
        ),
        "lssar p=3 triton fast": lambda: impl("triton", "lssar", 3.0, precise=False),
        "lssa flex": lambda: impl("flex", "lssa", None),
        "lssar p=15 flex": lambda: impl("flex", "lssar", 15.0),
    }
    out = []
    for label in wanted:
        needs = (
            "triton" if "triton" in label or "FA2" in label else "flex" if "flex" in label else ""
        )
        if needs and needs not in IMPLS:
            print(f"skipping {label!r}: impl {needs!r} is not available", file=sys.stderr)
            continue
        try:
            out.append((label, builders[label]()))
        except (ImportError, AttributeError) as e:
            print(f"skipping {label!r}: {e}", file=sys.stderr)
    return out


def _triton():
    import triton

    return triton


# ----------------------------------------------------------------------------- measurement


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
    row = {"ms": ms, "peak_mib": peak}
    if mode == "fwd" and "triton" in getattr(make, "label", ""):
        row["rms_vs_chunked"] = _error_vs_chunked(torch, make, q, k, v)
    return row


def _error_vs_chunked(torch, make, q, k, v) -> float:
    """RMS of the row's bf16 output minus ``impl="chunked"``'s in fp32 on the same inputs,
    relative to the latter's RMS (one batch element: chunked materialises blocks of scores)."""
    import lssar

    q1, k1, v1 = (x[:1].detach() for x in (q, k, v))
    with torch.no_grad():
        fast = make(q1, k1, v1)().float()
        ref = lssar.attention(
            q1.float(), k1.float(), v1.float(), is_causal=True, variant=make.variant,
            impl="chunked", **make.options,
        )  # fmt: skip
    return ((fast - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def flops(b: int, t: int, d: int, mode: str) -> float:
    fwd = 4.0 * b * HEADS * t * t * d / 2  # causal: half the score matrix
    return fwd if mode == "fwd" else 3.5 * fwd


def decode_cases(torch, wanted: list[str]) -> list[tuple[str, Callable]]:
    """``(label, make)`` of the decode labels: ``make(q, k, v)`` -> one step's callable."""
    import torch.nn.functional as F

    import lssar
    from lssar.ops import IMPLS

    def sdpa(q, k, v):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def flex(q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda: compiled(q, k, v, enable_gqa=True)

    def impl(variant, p, **impl_options):
        options = {} if p is None else {"p": p}

        def make(q, k, v):
            return lambda: lssar.attention(
                q, k, v, is_causal=True, variant=variant, impl="triton",
                impl_options=impl_options or None, enable_gqa=True, **options,
            )  # fmt: skip

        return make

    builders = {
        "softmax SDPA": sdpa,
        "softmax flex": flex,
        "lssa triton": impl("lssa", None),
        "lssar p=15 triton fast": impl("lssar", 15.0, precise=False),
        "lssar p=15 triton": impl("lssar", 15.0),
    }
    return [
        (label, builders[label]) for label in wanted if "triton" not in label or "triton" in IMPLS
    ]


def measure_decode(torch, triton, make, b: int, t_k: int, d: int) -> dict:
    """One decode step: median microseconds and the K/V bytes read per second."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hk = DECODE_HEADS // DECODE_GROUP
    q = torch.randn(b, DECODE_HEADS, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(b, hk, t_k, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    fn = make(q, k, v)
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, return_mode="median")
    kv_bytes = 2 * b * hk * t_k * d * 2
    return {"us": ms * 1e3, "gbps": kv_bytes / (ms * 1e-3) / 1e9}


# ----------------------------------------------------------------------------- plan and tables


def plan(args) -> tuple[list[tuple], list[tuple]]:
    """The prefill cells ``(d, t, b, mode, label)`` and decode cells ``(d, t_k, b, label)``."""
    prefill = [
        (d, t, max(1, TOKENS // t), mode, label)
        for d in args.head_dims
        for t in args.lengths
        for mode in args.modes
        for label in args.prefill_impls
    ]
    decode = [
        (d, t_k, b, label)
        for d in args.head_dims
        for t_k in args.decode_lengths
        for b in args.decode_batches
        for label in args.decode_impls
    ]
    return prefill, decode


def estimate_seconds(prefill: list[tuple], decode: list[tuple], tests: bool) -> float:
    """Dry-run estimate: the cells, plus one autotuning per Triton (kernel, shape key) pair
    (the forward, and for fwd+bwd the backward's kernels, per head dim and length bucket)."""
    tuned = {
        (d, t, label) for d, t, _, mode, label in prefill if "triton" in label or "FA2" in label
    }
    tuned_bwd = {
        (d, t, label)
        for d, t, _, mode, label in prefill
        if mode == "fwd+bwd" and ("triton" in label or "FA2" in label)
    }
    decode_tuned = {(d, label) for d, _, _, label in decode if "triton" in label}
    autotunes = len(tuned) + 2 * len(tuned_bwd) + len(decode_tuned)
    cells = len(prefill) + len(decode)
    return cells * SECONDS_PER_CELL + autotunes * SECONDS_PER_AUTOTUNE + (300 if tests else 0)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def tables(rows: list[dict], decode_rows: list[dict], env: dict, seconds: float) -> str:
    """Markdown: the prefill table, its 'x SDPA flash' and 'x FA2-style' summaries, decode."""
    out = [
        f"# Attention on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, "
        f"git {env['git_sha'][:10]}), {seconds / 60:.0f} minutes",
        "",
        f"bf16, causal, H={HEADS}, B*T={TOKENS} tokens. TFLOP/s in the softmax-equivalent "
        "convention (forward 4BHT^2D/2, forward+backward 3.5x that) for every row; "
        "'x flash' = SDPA-flash time / row time, 'x FA2-style' the same against the cost "
        "model's reference, same run (higher is better).",
        "",
        "| D | T | B | mode | impl | median ms | TFLOP/s | x flash | x FA2-style | peak MiB "
        "| RMS vs chunked | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['d']} | {r['t']} | {r['b']} | {r['mode']} | {r['impl']} | "
            f"{_fmt(r.get('ms'), '.3f')} | {_fmt(r.get('tflops'), '.1f')} | "
            f"{_fmt(r.get('x_flash'), '.2f')} | {_fmt(r.get('x_fa2'), '.2f')} | "
            f"{_fmt(r.get('peak_mib'), '.0f')} | {_fmt(r.get('rms_vs_chunked'), '.1e')} | "
            f"{r.get('error', '').replace('|', '/')} |"
        )
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    keys = sorted({(r["d"], r["mode"]) for r in rows}, key=lambda x: (x[1], x[0]))
    lengths = sorted({r["t"] for r in rows})
    for column, title in (("x_flash", "x SDPA flash"), ("x_fa2", "x FA2-style")):
        for d, mode in keys:
            out += ["", f"## {title}, D={d}, {mode}", ""]
            out.append("| impl | " + " | ".join(f"T={t}" for t in lengths) + " | target |")
            out.append("|---" * (len(lengths) + 2) + "|")
            for impl in impls:
                cells = []
                for t in lengths:
                    hit = [
                        r
                        for r in rows
                        if (r["d"], r["mode"], r["t"], r["impl"]) == (d, mode, t, impl)
                    ]
                    cells.append(_fmt(hit[0].get(column) if hit else None, ".2f"))
                target = TARGETS.get((impl, mode)) if column == "x_fa2" else None
                out.append(f"| {impl} | " + " | ".join(cells) + f" | {_fmt(target, '.2f')} |")
    if decode_rows:
        out += [
            "",
            f"## Decode: one query per head, {DECODE_HEADS} query heads, {DECODE_GROUP} per kv "
            "head, bf16",
            "",
            "| D | T_k | B | impl | us | K+V GB/s | x softmax SDPA | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in decode_rows:
            out.append(
                f"| {r['d']} | {r['t_k']} | {r['b']} | {r['impl']} | {_fmt(r.get('us'), '.1f')} "
                f"| {_fmt(r.get('gbps'), '.0f')} | {_fmt(r.get('x_softmax'), '.2f')} | "
                f"{r.get('error', '').replace('|', '/')} |"
            )
    return "\n".join(out) + "\n"


def _autotune_picks() -> dict:
    """The configs the Triton autotuners picked, per kernel and key (as strings)."""
    from lssar.ops.triton import autotune as A
    from lssar.ops.triton import decode as D

    tuners = {
        "fwd": A.fwd_tuned,
        "dq": A.dq_tuned,
        "dkdv": A.dkdv_tuned,
        "decode": D.decode_tuned,
    }
    return {name: {str(k): str(c) for k, c in t.cache.items()} for name, t in tuners.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results-gpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--impls", nargs="*", help="substrings selecting implementations")
    ap.add_argument("--decode-lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-decode", action="store_true", help="prefill only")
    ap.add_argument(
        "--quick", action="store_true", help="D=128, T=4K, decode at 16K (batch 1), main rows"
    )
    ap.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its estimate")
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.head_dims = [4096], [128]
        args.decode_lengths, args.decode_batches = [16384], [1]
        args.impls = args.impls or QUICK
    keep = (lambda label: any(s in label for s in args.impls)) if args.impls else None
    base = {"softmax SDPA flash", "softmax FA2-style (cost model's reference)", "softmax SDPA"}
    args.prefill_impls = [x for x in PREFILL if keep is None or x in base or keep(x)]
    args.decode_impls = [] if args.no_decode else [x for x in DECODE if keep is None or keep(x)]
    prefill, decode = plan(args)
    estimate = estimate_seconds(prefill, decode, not args.skip_tests)
    print(
        f"plan: {len(prefill)} prefill and {len(decode)} decode cells; estimated "
        f"{estimate / 60:.0f} minutes (an estimate, not a measurement: see SECONDS_PER_*)"
    )
    if args.dry_run:
        return 0

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

    t_start = time.time()
    # one compiled flex_attention entry per (shape, score_mod): the default limit of 8 would
    # silently drop the later lengths to the unfused eager path
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    args.out.mkdir(parents=True, exist_ok=True)
    env = _env(torch, triton)
    (args.out / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    tests_rc = None if args.skip_tests else run_gpu_tests(args.out)

    cases = dict(_cases(torch, args.prefill_impls))
    for label, make in cases.items():  # what the correctness check needs to know
        if "triton" in label:
            make.label = label
            make.variant = label.split()[0]
            make.options = {"p": float(label.split("p=")[1].split()[0])} if "p=" in label else {}
    rows: list[dict] = []
    done = 0
    for d, t, b, mode, label in prefill:
        if label not in cases:
            continue
        row = {"d": d, "t": t, "b": b, "mode": mode, "impl": label}
        try:
            row.update(measure(torch, triton, cases[label], b, t, d, mode))
            row["tflops"] = flops(b, t, d, mode) / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # one failing impl must not end the sweep
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        finally:
            torch.cuda.empty_cache()
        rows.append(row)
        done += 1
        print(
            json.dumps(row), f"[{done}/{len(prefill)}, {time.time() - t_start:.0f} s]", flush=True
        )
    for r in rows:  # ratios against the same cell's references
        for key, ref in (("x_flash", "softmax SDPA flash"), ("x_fa2", PREFILL[3])):
            hit = [
                x
                for x in rows
                if (x["d"], x["t"], x["mode"], x["impl"]) == (r["d"], r["t"], r["mode"], ref)
            ]
            if hit and "ms" in hit[0] and "ms" in r:
                r[key] = hit[0]["ms"] / r["ms"]
    decode_rows: list[dict] = []
    dcases = dict(decode_cases(torch, args.decode_impls))
    for d, t_k, b, label in decode:
        if label not in dcases:
            continue
        row = {"d": d, "t_k": t_k, "b": b, "impl": label}
        try:
            row.update(measure_decode(torch, triton, dcases[label], b, t_k, d))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        finally:
            torch.cuda.empty_cache()
        decode_rows.append(row)
        print(json.dumps(row), flush=True)
    for r in decode_rows:
        hit = [
            x
            for x in decode_rows
            if (x["d"], x["t_k"], x["b"], x["impl"]) == (r["d"], r["t_k"], r["b"], "softmax SDPA")
        ]
        if hit and "us" in hit[0] and "us" in r:
            r["x_softmax"] = hit[0]["us"] / r["us"]
    seconds = time.time() - t_start
    md = tables(rows, decode_rows, env, seconds)
    if tests_rc is not None:
        md += f"\nGPU kernel tests: exit code {tests_rc} (see gpu-tests.md).\n"
    md += f"\nEstimated beforehand: {estimate / 60:.0f} minutes; took {seconds / 60:.1f}.\n"
    (args.out / "results.md").write_text(md)
    result = {
        "env": env,
        "tests_exit_code": tests_rc,
        "seconds": seconds,
        "estimated_seconds": estimate,
        "rows": rows,
        "decode": decode_rows,
        "autotune": _autotune_picks(),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
