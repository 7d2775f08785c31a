"""Ahead-of-time compile check of the Triton kernels for sm_80 / sm_90, on a machine without a GPU.

``python -m lssar.ops.triton.devtools.compile_check [--grid reduced|full|tf32|fast] [--arch 80 90]
[--kept-only] [--riskiest N] [--jobs N] [--cache DIR] [--json FILE]`` (exit status 1 if
:func:`problems` finds any: a build that does not compile, or a config the autotuner keeps that
spills registers or exceeds shared memory).

The interpreter (how the tests run the kernels without a GPU) accepts code that real hardware
rejects or runs slowly. This module compiles every ``@triton.jit`` kernel x every autotune config
x every constexpr combination that :mod:`lssar.ops.triton.host` launches with the real Triton
compiler (``triton.compile`` with a ``GPUTarget``: PTX, then a cubin from the wheel's ``ptxas``),
and reports per build: compiled or the error, shared memory per block against the arch's limit,
registers, spill stores / loads (``ptxas -v``), and tensor-core instructions (HMMA / HGMMA)
counted in the SASS (``cuobjdump -sass``).

Nothing here copies a table of launches: :func:`launches` runs the host's own ``_forward`` and
``_backward`` on small CPU tensors with its ``_launch`` replaced by a recorder, so the kernels,
pointer dtypes, strides, scalars and constexprs are exactly what the host passes; the JIT's own
binder then specialises them (integer ``1`` -> constexpr, 16-divisibility) as a launch would, and
the autotuner's own ``prune_configs_by`` marks which configs it may pick for that launch.

Results are cached as JSON per build (key: the Triton source hash of the specialised kernel,
target, options, Triton version) under ``$LSSAR_COMPILE_CACHE`` or
``~/.cache/lssar/compile_check``: a rerun recompiles only what changed. ``TRITON_INTERPRET=1``
must not be set (the kernels would be decorated for the interpreter).

One module (~630 lines): one developer tool's pipeline (grid -> launches -> builds -> cache ->
table -> problems), each stage consumed only by the next; it ships in no kernel path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import triton

from lssar.ops.spans import key_spans
from lssar.ops.triton import autotune as A
from lssar.ops.triton import decode as DEC
from lssar.ops.triton import host
from lssar.ops.triton import kernels as K
from lssar.ops.triton.devtools.sass import loop_counts, opcode_counts, sass
from lssar.ops.variants import VARIANTS

# Largest shared memory one block may use (opt-in dynamic maximum), bytes.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
ARCHS = (80, 90)
# Sequence length of the recorded launches: a training length. It only sets the autotuner's
# length bucket (tq_key, tk_key; row tiles taller than T_q are pruned for decoding) and the
# 16-divisibility of lengths and strides, as a real launch of that length would.
SEQ_LEN = 1024
BATCH, HEADS = 2, 4  # not 1: the JIT would turn H = 1 into a constant

_SCHEMA = 3  # version of the measurements' format: part of the cache key (3: per-loop counts, FLOP)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Case:
    """One combination of what a caller can choose: head dim, dtype, causal, variant, mask, and
    key spans (``spans``: "" none, "window" packed documents with a sliding window, "sinks" the
    same with sink tokens; the causal rule is then folded into the spans, as ``lssar.attention``
    does, and the kernels run with ``HAS_SPANS`` / ``HAS_SINKS``); ``tf32``: launched with
    ``torch.backends.cuda.matmul.allow_tf32`` set (fp32 inputs then run on TF32 tensor cores,
    ``IEEE=False``; no effect on half-precision inputs); ``precise``: the host's option of that
    name (``False``: half-precision weights go into the value product rounded once, ``SPLIT=False``;
    no effect on fp32 inputs)."""

    head_dim: int
    dtype: str  # a key of _DTYPES
    causal: bool
    variant: str  # a name in lssar.ops.variants.VARIANTS
    mask: bool
    spans: str = ""  # a key of _SPANS
    tf32: bool = False
    precise: bool = True
    deterministic: bool = False
    decode: int = 0  # > 0: a decode step of this many packed query rows (G x T_q), no backward

    @property
    def label(self) -> str:
        """Short, stable description, e.g. ``lssar d128 bf16 causal``."""
        flags = ("causal" if self.causal else "full") + (" mask" if self.mask else "")
        flags += f" {self.spans}" if self.spans else ""
        flags += " tf32" if self.tf32 else ""
        flags += "" if self.precise else " fast"
        flags += " det" if self.deterministic else ""
        flags += f" decode{self.decode}" if self.decode else ""
        return f"{self.variant} d{self.head_dim} {self.dtype} {flags}"


def _both_backwards(cases: list[Case]) -> list[Case]:
    """``cases`` with the default backward (dq fused into dk/dv) and each again with
    ``deterministic=True`` (the dq kernel, dk/dv without atomics); the forward and rows launches
    of a twin are the same builds (compiled once)."""
    return cases + [dataclasses.replace(c, deterministic=True) for c in cases]


# the spans of a case: documents of SEQ_LEN // 3 and the rest, a 256-key window, 4 sinks
_SPANS = {"": None, "window": 0, "sinks": 4}


def grid(name: str) -> list[Case]:
    """The cases of a named grid.

    ``full``: head dim 64/128/256 x bf16/fp16/fp32 x causal or not x lssa/lssar x mask or not,
    and the same head dims, dtypes and variants with causal spans (window, window + sinks), and
    fp32 with TF32 allowed (head dim x causal or not x lssa/lssar x mask or not, and the spans),
    each with the default backward (dq fused into dk/dv) and with ``deterministic=True`` (the dq
    kernel); and decode steps (head dim 64/128/256 x bf16/fp16 x lssa/lssar x a key padding mask
    or not x 16 or 64 packed query rows, the decode kernel's BM, where the host takes the decode
    kernel: rows x head dim <= ``decode.MAX_ROW_ELEMENTS``). ``reduced`` (the default test
    run): the combinations whose resources differ most (head dim 128 in bf16 and fp32, head dim
    64 and 256 in bf16, causal, lssar; one lssa and one masked case; one with spans and sinks,
    the superset of the span code; one with ``precise=False``; one with ``deterministic=True``;
    bf16 decode steps with 16 rows, and with 64 rows and a mask);
    causal, mask
    and spans add a few integer ops per element and move no tile size. ``tf32``: the 13 fp32 cases
    with TF32 allowed that the TF32 pruning was set from (lssar head dim 64/128/256 causal, with a
    mask, sinks, a window; lssa 64/128). ``fast``: the ``full`` grid's bf16 / fp16 cases with
    ``precise=False`` (``impl_options={"precise": False}``), which only the half-precision launches
    read.
    """
    if name == "full":
        plain = [
            Case(d, dt, c, v, m)
            for d in (64, 128, 256)
            for dt in ("bf16", "fp16", "fp32")
            for c in (True, False)
            for v in ("lssa", "lssar")
            for m in (False, True)
        ]
        spans = [
            Case(d, dt, True, v, False, sp)
            for d in (64, 128, 256)
            for dt in ("bf16", "fp16", "fp32")
            for v in ("lssa", "lssar")
            for sp in ("window", "sinks")
        ]
        tf32 = [
            Case(d, "fp32", c, v, m, tf32=True)
            for d in (64, 128, 256)
            for c in (True, False)
            for v in ("lssa", "lssar")
            for m in (False, True)
        ] + [
            Case(d, "fp32", True, v, False, sp, tf32=True)
            for d in (64, 128, 256)
            for v in ("lssa", "lssar")
            for sp in ("window", "sinks")
        ]
        decode = [  # the steps the host runs on the decode kernel (decode.applies)
            Case(d, dt, True, v, m, decode=rows)
            for d in (64, 128, 256)
            for dt in ("bf16", "fp16")
            for v in ("lssa", "lssar")
            for m in (False, True)
            for rows in (16, 64)
            if rows * d <= DEC.MAX_ROW_ELEMENTS
        ]
        return _both_backwards(plain + spans + tf32) + decode
    if name == "reduced":
        return [
            Case(128, "bf16", True, "lssar", False),
            Case(128, "fp32", True, "lssar", False),
            Case(64, "bf16", True, "lssar", False),
            Case(256, "bf16", True, "lssar", False),
            Case(128, "bf16", True, "lssa", False),
            Case(128, "fp16", False, "lssar", True),
            Case(128, "bf16", True, "lssar", False, "sinks"),
            Case(128, "bf16", True, "lssar", False, precise=False),
            Case(128, "bf16", True, "lssar", False, deterministic=True),
            Case(128, "bf16", True, "lssar", False, decode=16),
            Case(128, "bf16", True, "lssar", True, decode=64),
        ]
    if name == "tf32":  # the cases TF32_REG_BUDGET and the "tf32" MEASURED_SPILLS were set on
        return [
            Case(d, "fp32", c, v, m, sp, tf32=True)
            for d, c, v, m, sp in [
                (64, True, "lssar", False, ""),
                (128, True, "lssar", False, ""),
                (256, True, "lssar", False, ""),
                (128, True, "lssar", False, "sinks"),
                (128, True, "lssa", False, ""),
                (128, False, "lssar", True, ""),
                (64, False, "lssar", True, ""),
                (256, False, "lssar", True, ""),
                (64, True, "lssar", False, "sinks"),
                (256, True, "lssar", False, "sinks"),
                (128, True, "lssa", False, "sinks"),
                (128, True, "lssar", False, "window"),
                (64, True, "lssa", False, ""),
            ]
        ]
    if name == "fast":
        return [
            dataclasses.replace(c, precise=False)
            for c in grid("full")
            if c.dtype in ("bf16", "fp16")
        ]
    raise ValueError(f"unknown grid {name!r}: 'reduced', 'full', 'tf32' or 'fast'")


@dataclasses.dataclass
class Launch:
    """One kernel launch the host makes for a case: the kernel, its autotuner, its arguments."""

    name: str  # fwd, rows, dq, dkdv
    kernel: Any  # triton.runtime.JITFunction
    tuned: Any  # triton.runtime.Autotuner
    args: tuple
    kwargs: dict


_NAMES = {
    "fwd_kernel": "fwd",
    "bwd_rows_kernel": "rows",
    "bwd_dq_kernel": "dq",
    "bwd_dkdv_kernel": "dkdv",
    "decode_kernel": "decode",
}


@contextlib.contextmanager
def _allow_tf32(on: bool):
    # torch's flag, which the host reads at launch (not a plain attribute: no mock.patch)
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = on
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def launches(case: Case) -> list[Launch]:
    """The launches ``host._forward`` and ``host._backward`` make for ``case`` (recorded), or
    ``host._decode``'s for a decode case."""
    if K.INTERPRETED:
        raise RuntimeError(
            "the kernels were decorated for the interpreter: unset TRITON_INTERPRET and rerun"
        )
    variant = VARIANTS[case.variant]
    dtype = _DTYPES[case.dtype]
    shape = (BATCH, HEADS, SEQ_LEN, case.head_dim)
    q, k, v = (torch.zeros(shape, dtype=dtype) for _ in range(3))
    mask = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool) if case.mask else None
    if case.decode:  # one kv head for the HEADS query heads, decode // HEADS queries each
        q = torch.zeros(BATCH, HEADS, case.decode // HEADS, case.head_dim, dtype=dtype)
        k, v = (torch.zeros(BATCH, 1, SEQ_LEN, case.head_dim, dtype=dtype) for _ in range(2))
        mask = torch.ones(BATCH, 1, 1, SEQ_LEN, dtype=torch.bool) if case.mask else None
    c, log_n = variant.softplus_scale(case.head_dim, None)
    p = variant.options.get("p")
    p = None if p is None else float(p)
    spans = None
    if case.spans:
        third = SEQ_LEN // 3
        spans = key_spans(
            SEQ_LEN, SEQ_LEN, torch.device("cpu"), case.causal,
            cu_seqlens=torch.tensor([0, third, SEQ_LEN]), window=(255, 0),
            sink_tokens=_SPANS[case.spans],
        )  # fmt: skip
    causal = case.causal and spans is None  # folded into the spans, as lssar.attention does
    args = (mask, causal, float(c), log_n, bool(variant.qk_norm), p, case.precise)
    recorded: list[Launch] = []

    def record(kernel, tuned, rows, parallel, *a, **kw):
        name = _NAMES.get(kernel.fn.__name__, kernel.fn.__name__)
        name += str(kw["PASS"]) if name == "decode" else ""  # LSSAR's two decode launches
        name += "-train" if kw.get("FOLD_F") else ""  # LSSAR's forward for a backward
        recorded.append(Launch(name, kernel, tuned, a, kw))

    with mock.patch.object(host, "_launch", record), _allow_tf32(case.tf32):
        if case.decode:
            host._decode(q, k, v, *args)
            return recorded
        if p is not None:  # LSSAR's inference forward (no F_i vectors; LSSA's is the same)
            host._forward(q, k, v, *args, spans, for_backward=False)
        out, stats, aux = host._forward(q, k, v, *args, spans)
        grad = torch.zeros_like(out)
        host._backward(grad, q, k, v, out, mask, stats, aux, *args[1:], case.deterministic, spans)
    return recorded


@dataclasses.dataclass
class Build:
    """One compile job: a specialised kernel, one autotune config, one target arch."""

    case: Case
    kernel: str  # fwd, rows, dq, dkdv (or a reference kernel's name)
    config: str  # "BMxBN wW sS"
    arch: int
    kept: bool  # whether the autotuner's pruning keeps this config for this launch
    module: str  # where the @triton.jit function lives
    fn_name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str  # cache key


def _config_label(cfg: triton.Config, launch: dict | None = None) -> str:
    """``"BMxBN wW sS"`` (``"BM wW sS"`` for a kernel without key blocks), then the dk/dv
    formulation's flags that are set (``key-major``, ``one-grad``); a tile size the launch
    passes itself (the decode kernel's ``BM``) from ``launch``."""
    kw = {**(launch or {}), **cfg.kwargs}
    flags = "".join(f" {f}" for k, f in _FLAGS.items() if kw.get(k, False))
    tile = f"{kw['BM']}x{kw['BN']}" if "BN" in kw else str(kw["BM"])  # rows: no key blocks
    return f"{tile} w{cfg.num_warps} s{cfg.num_stages}{flags}"


_FLAGS = {"KEY_MAJOR": "key-major", "ONE_GRAD": "one-grad"}


def specialise(kernel, args: tuple, kwargs: dict, arch: int) -> tuple[dict, dict, dict, dict]:
    """``(signature, constexprs, attrs, options)`` exactly as ``kernel[grid](*args, **kwargs)``
    would build them on a device of compute capability ``arch`` (Triton's own binder)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kw = {"debug": False, **kwargs}
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, opts)
    return signature, constexprs, attrs, dict(options.__dict__)


def _risk(ln: Launch, cfg: triton.Config) -> tuple[float, int]:
    kind = ln.name.removesuffix("-train")
    if kind not in A.REG_BUDGET:  # a kernel the estimates do not know: every config is risky
        return float("inf"), 0
    bm, bn, bd, bdv = cfg.kwargs["BM"], cfg.kwargs["BN"], ln.kwargs["BD"], ln.kwargs["BDV"]
    ieee, tf32 = A.precision(dict(zip(ln.kernel.arg_names, ln.args)), ln.kwargs)
    esize = 4 if ieee or tf32 else 2
    words = A._cfg_words(kind, cfg, bd, bdv, esize)
    return words, A._shared_bytes(kind, bm, bn, cfg.num_stages, bd, bdv, esize)


def _cache_key(kernel, signature, constexprs, attrs, options, arch) -> str:
    from triton.compiler import ASTSource

    src = ASTSource(kernel, signature, constexprs, attrs).hash()
    opts = json.dumps({k: repr(v) for k, v in sorted(options.items())})
    blob = f"{src}|{arch}|{opts}|{triton.__version__}|{_SCHEMA}"
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def builds(
    cases: list[Case], archs: tuple[int, ...], kept_only: bool = False, riskiest: int = 0
) -> list[Build]:
    """Every (launch of every case) x (every config of its autotuner) x arch; ``kept_only``: only
    the configs the autotuner's pruning keeps for that launch (the ones a GPU may run);
    ``riskiest > 0``: only that many kept configs per launch, those closest to spilling by the
    kernels' own estimate (:func:`lssar.ops.triton.autotune.fits`'s live words, then shared
    memory): a quick check of the pruning's edge; the full grid checks every config."""
    out = []
    for case in cases:
        for ln in launches(case):
            nargs = dict(zip(ln.kernel.arg_names, ln.args))
            for arch in archs:
                pruned = ln.tuned.configs
                if ln.tuned.early_config_prune:  # the pruning on a device of this arch
                    with mock.patch.object(A, "device_arch", lambda arch=arch: arch):
                        pruned = ln.tuned.early_config_prune(ln.tuned.configs, nargs, **ln.kwargs)
                chosen = pruned if kept_only or riskiest else ln.tuned.configs
                if riskiest:
                    chosen = sorted(chosen, key=lambda c: _risk(ln, c), reverse=True)[:riskiest]
                for cfg in chosen:
                    kw = {**ln.kwargs, **cfg.all_kwargs()}
                    sig, cst, attrs, opts = specialise(ln.kernel, ln.args, kw, arch)
                    out.append(
                        Build(
                            case, ln.name, _config_label(cfg, ln.kwargs), arch, cfg in pruned,
                            ln.kernel.fn.__module__, ln.kernel.fn.__name__,
                            sig, cst, attrs, opts,
                            _cache_key(ln.kernel, sig, cst, attrs, opts, arch),
                        )
                    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- compile, measure

# the ptxas -v log
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def compile_one(module: str, fn_name: str, signature, constexprs, attrs, options, arch) -> dict:
    """Compile one build in this process; returns its measurements (or its error) as a dict.

    Triton's own cache is bypassed (a private temporary cache dir) so that ``ptxas -v`` always
    runs and its log (registers, spills) can be read; :func:`run` caches the measurements.
    """
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), fn_name)
    t0 = time.perf_counter()
    log = io.StringIO()
    tmp = tempfile.mkdtemp(prefix="lssar-cc-")
    try:
        with knobs.cache.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.cache.dir = tmp
            knobs.nvidia.dump_ptxas_log = True
            ck = triton.compile(
                ASTSource(fn, signature, constexprs, attrs),
                target=GPUTarget("cuda", arch, 32),
                options=options,
            )
    except Exception as e:  # a failed compile is a result to report, not a crash of the check
        msg = str(e).strip().splitlines()
        return {"ok": False, "error": f"{type(e).__name__}: {msg[-1] if msg else ''}"[:300]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = log.getvalue()
    spill = _SPILL.search(text)
    regs = _REGS.search(text)
    instrs = sass(ck.asm["cubin"])
    return {
        "ok": True,
        "seconds": round(time.perf_counter() - t0, 2),
        "shared": int(ck.metadata.shared),
        "regs": int(regs[1]) if regs else None,
        "spill_store": int(spill[1]) if spill else 0,
        "spill_load": int(spill[2]) if spill else 0,
        **opcode_counts(instrs),
        "loop": loop_counts(instrs),
    }


def _compile_build(b: Build) -> dict:
    return compile_one(b.module, b.fn_name, b.signature, b.constexprs, b.attrs, b.options, b.arch)


def cache_dir() -> Path:
    """The measurement cache: ``$LSSAR_COMPILE_CACHE`` or ``~/.cache/lssar/compile_check``."""
    env = os.environ.get("LSSAR_COMPILE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lssar" / "compile_check"


# the measurements an entry holds (compile_one's dict); anything else is an unreadable entry
_COUNTS = ("shared", "spill_store", "spill_load", *opcode_counts([]))
_LOOP = loop_counts([])  # each field with the type it holds (counts; "each": a list per loop)


def _valid(entry: object) -> bool:
    """Whether ``entry`` is a measurement :func:`compile_one` could have written."""
    if not isinstance(entry, dict) or not isinstance(entry.get("ok"), bool):
        return False
    if not entry["ok"]:
        return isinstance(entry.get("error"), str)
    loop = entry.get("loop")
    return (
        all(type(entry.get(k)) is int for k in _COUNTS)
        and "regs" in entry
        and (entry["regs"] is None or type(entry["regs"]) is int)
        and isinstance(loop, dict)
        and all(type(loop.get(k)) is type(v) for k, v in _LOOP.items())
    )


def read_cache(blds: list[Build], cache: Path) -> tuple[dict[str, dict], list[Build]]:
    """``(key -> measurements cached in cache, builds to compile)``. An entry that does not
    read back (truncated, edited, another format: a JSON error, a missing or mistyped field)
    is a miss, rebuilt and overwritten, and said once on stderr; it never stops the check."""
    results: dict[str, dict] = {}
    todo: list[Build] = []
    bad: list[Path] = []
    for b in blds:
        if b.key in results or b.key in {t.key for t in todo}:
            continue
        f = cache / f"{b.key}.json"
        if f.exists():
            try:
                entry = json.loads(f.read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                entry = None
            if _valid(entry):
                results[b.key] = entry
                continue
            bad.append(f)
        todo.append(b)
    if bad:
        print(
            f"compile_check: {len(bad)} unreadable cache entr{'y' if len(bad) == 1 else 'ies'} "
            f"(e.g. {bad[0]}) treated as missing: rebuilt and overwritten",
            file=sys.stderr,
            flush=True,
        )
    return results, todo


def run(
    blds: list[Build],
    jobs: int = 2,
    cache: Path | None = None,
    compile_build: Callable[[Build], dict] | None = None,
) -> list[dict]:
    """Measure every build (cached ones from ``cache``, the rest compiled in ``jobs`` processes,
    or in this one for ``jobs=1``; ``compile_build``: the compiler, default
    :func:`compile_one`)."""
    cache = cache_dir() if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    compile_build = compile_build or _compile_build
    results, todo = read_cache(blds, cache)
    if todo:
        # spawn, not fork: the parent has run torch ops (OpenMP threads must not be forked)
        import multiprocessing as mp

        with contextlib.ExitStack() as stack:
            if jobs > 1:
                ex = stack.enter_context(
                    ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
                )
                measured = ex.map(compile_build, todo)
            else:
                measured = map(compile_build, todo)
            for b, res in zip(todo, measured):
                results[b.key] = res
                # temp file then rename: a killed check leaves no half entry (ops sits below
                # lssar.runio's atomic_write in the layers, so not that)
                entry = cache / f"{b.key}.json"
                tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(res))
                os.replace(tmp, entry)
    return [{**_row_id(b), **results[b.key]} for b in blds]


def _row_id(b: Build) -> dict:
    return {
        "case": b.case.label,
        **dataclasses.asdict(b.case),
        "kernel": b.kernel,
        "config": b.config,
        "arch": b.arch,
        "kept": b.kept,
        "shared_limit": SHARED_LIMIT[b.arch],
    }


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table (``kept``: the autotuner may pick the config)."""
    head = (
        "| case | kernel | config | sm | kept | ok | shared KB / limit | regs | spill B (st/ld) "
        "| HGMMA | HMMA |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if not r["ok"]:
            lines.append(
                f"| {r['case']} | {r['kernel']} | {r['config']} | {r['arch']} | "
                f"{'yes' if r['kept'] else 'no'} | ERROR: {r['error']} | | | | | |"
            )
            continue
        over = " OVER" if r["shared"] > r["shared_limit"] else ""
        spill = f"{r['spill_store']}/{r['spill_load']}" if r["spill_store"] else "0"
        lines.append(
            f"| {r['case']} | {r['kernel']} | {r['config']} | {r['arch']} | "
            f"{'yes' if r['kept'] else 'no'} | yes | {r['shared'] / 1024:.0f} / "
            f"{r['shared_limit'] // 1024}{over} | {r['regs']} | {spill} | "
            f"{r['hgmma']} | {r['hmma']} |"
        )
    return "\n".join(lines)


def problems(rows: list[dict]) -> list[str]:
    """What the tests refuse: a failed compile, a config over shared memory that the autotuner may
    pick, a kept config that spills. (Whether sm_90 builds use HGMMA depends on the tile: the
    test checks it where an MMA tile is 64 rows or more.)"""
    out = []
    for r in rows:
        where = f"{r['case']} {r['kernel']} {r['config']} sm_{r['arch']}"
        if not r["ok"]:
            out.append(f"{where}: does not compile ({r['error']})")
            continue
        if r["kept"] and r["shared"] > r["shared_limit"]:
            out.append(f"{where}: {r['shared']} B shared memory > {r['shared_limit']}")
        if r["kept"] and r["spill_store"] + r["spill_load"] > 0:
            out.append(f"{where}: spills {r['spill_store']}/{r['spill_load']} B")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: compile the grid, print the table, exit 1 if :func:`problems` finds any."""
    ap = argparse.ArgumentParser(
        prog="python -m lssar.ops.triton.devtools.compile_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--grid", default="reduced", choices=("reduced", "full", "tf32", "fast"))
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument(
        "--kept-only", action="store_true", help="only configs the autotuner's pruning keeps"
    )
    ap.add_argument(
        "--riskiest", type=int, default=0, help="only the N kept configs closest to spilling"
    )
    ap.add_argument("--jobs", type=int, default=2, help="compiler processes (default 2)")
    ap.add_argument("--cache", type=Path, default=None, help="measurement cache directory")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    blds = builds(grid(a.grid), tuple(a.arch), a.kept_only, a.riskiest)
    rows = run(blds, a.jobs, a.cache)
    print(table(rows))
    bad = problems(rows)
    print(f"\n{len(rows)} builds, {time.perf_counter() - t0:.0f} s; {len(bad)} problems")
    for line in bad:
        print("  " + line)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
