"""The fused CPU kernel (``csrc/softplus_attention.cpp``): built once on first use, then cached.

``torch.utils.cpp_extension`` compiles the C++ source with the machine's compiler into the torch
extensions cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); later
processes load the cached library in milliseconds, and an edited source is rebuilt. ``make setup``
builds it ahead of time (``python -m lssar.ops.cpu_kernel``). A machine without a compiler (or
without ninja) gets the eager path of ``impl="chunked"`` and one warning saying why.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("csrc") / "softplus_attention.cpp"
DISABLE_ENV = "LSSAR_NO_CPU_KERNEL"  # set to 1 to use the eager path (debugging, comparisons)
ISA_ENV = "LSSAR_CPU_KERNEL_ISA"  # AVX2 or AVX512: build for that ISA instead of the best one

_loaded: dict[str, ModuleType | None] = {}


# Vector flags per ISA torch reports: at::vec::Vectorized<float> is then 8 (AVX2) or 16 (AVX-512)
# lanes, as in torch's own kernels for that ISA (its exp_u20 and Sleef come from libtorch_cpu).
ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
}


def runnable_isas() -> list[str]:
    """The vector ISAs with a build that this machine can run (AVX-512 machines also run AVX2)."""
    order = list(ISA_FLAGS)
    cap = torch.backends.cpu.get_cpu_capability()
    if platform.machine() not in ("x86_64", "AMD64") or cap not in order:
        return []
    return order[: order.index(cap) + 1]


def build_isa() -> str | None:
    """The ISA to build for: ``$LSSAR_CPU_KERNEL_ISA`` when set (one this machine runs), else the
    best this machine runs (None: portable code)."""
    runnable = runnable_isas()
    want = os.environ.get(ISA_ENV, "")
    if want and want not in runnable:
        raise ValueError(
            f"{ISA_ENV}={want!r} is not a vector ISA this machine runs; "
            f"set it to one of {runnable or 'none (this machine gets portable code)'} or unset it"
        )
    return want or (runnable[-1] if runnable else None)


def _flags(isa: str | None = None) -> list[str]:
    """Compiler flags for ``isa`` (default: :func:`build_isa`); no ISA gets portable code."""
    isa = isa or build_isa()
    return ["-O3", "-fopenmp", *ISA_FLAGS.get(isa or "", [])]


def _name(flags: list[str]) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    return f"lssar_cpu_kernel_{digest}"


def load(verbose: bool = False, isa: str | None = None) -> ModuleType:
    """Build (if needed) and import the kernel for ``isa`` (default: this machine's); raises what
    the build raised."""
    from torch.utils.cpp_extension import load as cpp_load

    flags = _flags(isa)
    return cpp_load(
        name=_name(flags),
        sources=[str(SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


def kernel() -> ModuleType | None:
    """The compiled kernel, or ``None`` (after one warning) where it cannot be built."""
    if "mod" not in _loaded:
        mod = None
        if os.environ.get(DISABLE_ENV, "") in ("", "0"):
            # a bad LSSAR_CPU_KERNEL_ISA is the user's error: raised here, not a fallback
            isa = build_isa()
            try:
                mod = load(isa=isa)
            except Exception as exc:  # no compiler, no ninja, a failed build: fall back
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                warnings.warn(
                    f"lssar: the fused CPU attention kernel could not be built "
                    f"({type(exc).__name__}: {first}); impl='cpu' falls back to the eager "
                    f"chunked path (slower, same results). Install a C++ compiler and ninja "
                    f"to enable it.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _loaded["mod"] = mod
    return _loaded["mod"]


if __name__ == "__main__":  # `python -m lssar.ops.cpu_kernel`: build now (make setup)
    mod = kernel()
    print("lssar: fused CPU kernel", "ready" if mod is not None else "unavailable (eager path)")
