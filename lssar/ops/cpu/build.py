"""The fused CPU kernel (``softplus_attention.cpp`` beside this file): built once per environment,
then cached.

The library lives in the torch extensions cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions/py<ver>_cpu``) in an entry named by a digest of everything the
compiled code depends on (:func:`environment`): the source's content, the compiler flags (the
vector ISA), the torch version and headers (so the virtualenv), the Python ABI and headers, and
the compiler binary. Two checkouts, venvs or compilers therefore get two entries instead of
rebuilding one in turn, and an edited source gets a new entry.

How a build can never hang nor leave a broken entry (``make setup`` runs it ahead of time:
``python -m lssar.ops.cpu.build``, or its old name ``python -m lssar.ops.cpu_kernel``):

- An entry is complete once it exists: it is built in a fresh directory beside it (from a copy of
  the source, so the checkout path is not part of the build) and renamed into place, atomically.
  Loading a complete entry takes no lock at all.
- Builders of one entry take turns on an OS file lock (``flock`` on ``<entry>.lock``), which the
  kernel releases when its holder exits or is killed: a killed build leaves no stale lock (its
  half-built directory is removed by the next builder). A process that finds the lock held says so
  on stderr and waits up to ``$LSSAR_CPU_KERNEL_WAIT`` seconds (default 600) for that build, then
  gives up: like a machine without a compiler (or ninja), it gets the eager path of
  ``impl="chunked"`` with one warning saying why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # not POSIX: builds may run twice, the atomic rename still keeps entries whole
    fcntl = None

SOURCE = Path(__file__).with_name("softplus_attention.cpp")
DISABLE_ENV = "LSSAR_NO_CPU_KERNEL"  # set to 1 to use the eager path (debugging, comparisons)
ISA_ENV = "LSSAR_CPU_KERNEL_ISA"  # AVX2 or AVX512: build for that ISA instead of the best one
WAIT_ENV = "LSSAR_CPU_KERNEL_WAIT"  # seconds to wait for another process's build of the entry
DEFAULT_WAIT_S = 600.0  # a build takes about a minute on 2 idle cores, several on a busy machine
POLL_S = 0.2
LIB_SUFFIX = ".pyd" if os.name == "nt" else ".so"  # as torch.utils.cpp_extension names it

_loaded: dict[str, ModuleType | None] = {}


# Vector flags per ISA torch reports: at::vec::Vectorized<float> is then 8 (AVX2) or 16 (AVX-512)
# lanes, as in torch's own kernels for that ISA (its exp_u20 and Sleef come from libtorch_cpu);
# F16C (on every AVX2 CPU) converts fp16 caches in the decode entry.
ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
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


def _compiler() -> dict[str, Any]:
    """The C++ compiler torch's build runs (``$CXX``, default ``c++``): its real path, size and
    mtime, so an upgraded or different compiler is a different entry."""
    found = shutil.which(os.environ.get("CXX", "c++"))
    if found is None:
        return {"cxx": os.environ.get("CXX", "c++"), "found": False}
    real = os.path.realpath(found)
    st = os.stat(real)
    return {"cxx": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def environment(isa: str | None = None) -> dict[str, Any]:
    """Everything the compiled library depends on besides its source: part of the entry's key.

    The checkout path is not (the build compiles a copy of the source); the virtualenv is,
    through torch's headers, and so are the Python ABI and headers and the compiler.
    """
    torch_dir = Path(torch.__file__).resolve().parent
    return {
        "flags": _flags(isa),
        "ldflags": ["-fopenmp"],
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_include": str(torch_dir / "include"),
        "python_abi": sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag,
        "python_include": sysconfig.get_paths()["include"],
        "compiler": _compiler(),
    }


def entry_name(isa: str | None = None) -> str:
    """The cache entry (and module) name: a digest of the source and :func:`environment`."""
    key = SOURCE.read_bytes() + json.dumps(environment(isa), sort_keys=True).encode()
    return f"lssar_cpu_kernel_{hashlib.sha256(key).hexdigest()[:16]}"


def cache_root() -> Path:
    """``$TORCH_EXTENSIONS_DIR``, else torch's default folder for this Python on CPU."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    v = sys.version_info
    abi = getattr(sys, "abiflags", "")
    return Path(get_default_build_root()) / f"py{v.major}{v.minor}{abi}_cpu"


def entry_dir(isa: str | None = None) -> Path:
    """Where the kernel for ``isa`` (default: this machine's) is, or will be, cached."""
    return cache_root() / entry_name(isa)


def _library(entry: Path) -> Path:
    return entry / f"{entry.name}{LIB_SUFFIX}"


def _import(name: str, path: Path) -> ModuleType:
    """Import the extension module ``name`` from ``path`` (as torch's loader does)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_s() -> float:
    raw = os.environ.get(WAIT_ENV, "")
    try:
        wait = float(raw) if raw else DEFAULT_WAIT_S
    except ValueError:
        wait = -1.0
    if not 0 <= wait < float("inf"):
        raise ValueError(f"{WAIT_ENV}={raw!r} must be a number of seconds >= 0, or unset")
    return wait


@contextlib.contextmanager
def _build_lock(path: Path, wait_s: float) -> Iterator[bool]:
    """Hold the OS lock on ``path`` (True), or yield False after ``wait_s`` seconds of another
    holder. The lock is the ``flock``, not the file: the kernel drops it when its holder exits or
    is killed, so a file left behind is never stale (and is not removed: a waiter may hold it
    open)."""
    if fcntl is None:
        yield True
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                if not told:
                    holder = path.read_text().strip() or "?"
                    print(
                        f"lssar: waiting for process {holder} to finish building the fused CPU "
                        f"kernel ({path}); up to {wait_s:g} s (${WAIT_ENV}), then impl='cpu' "
                        "runs the eager path",
                        file=sys.stderr,
                        flush=True,
                    )
                    told = True
                time.sleep(POLL_S)
            except OSError:  # a file system without flock: build unlocked (the rename is atomic)
                break
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield True
    finally:
        os.close(fd)


def _compile(name: str, source: Path, build_dir: Path, flags: list[str], verbose: bool):
    """Compile ``source`` into ``build_dir`` as the module ``name`` and import it."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER
    from torch.utils.cpp_extension import load as cpp_load

    # torch renames a second build of one name in a process (another directory) to name_v1,
    # a library the entry would then not hold under its name
    JIT_EXTENSION_VERSIONER.entries.pop(name, None)

    return cpp_load(
        name=name,
        sources=[str(source)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=verbose,
    )


def _build(entry: Path, flags: list[str], verbose: bool) -> ModuleType | None:
    """Build ``entry`` unless another process does; its module, or None when that process built
    it (then import the entry)."""
    root, name = entry.parent, entry.name
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f"{name}.lock"
    wait = _wait_s()
    with _build_lock(lock, wait) as held:
        if not held:
            holder = lock.read_text().strip() or "?"
            raise TimeoutError(
                f"process {holder} has held the build lock {lock} for {wait:g} s; let it "
                f"finish, or raise ${WAIT_ENV}"
            )
        if _library(entry).exists():  # the process we waited for built it
            return None
        for stale in root.glob(f".{name}.build-*"):  # builds killed before they finished
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():  # an entry without its library (not ours: we rename whole ones)
            shutil.rmtree(entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache's entry from others
            source = tmp / SOURCE.name
            shutil.copyfile(SOURCE, source)
            print(
                f"lssar: building the fused CPU kernel (once per environment, about a minute) "
                f"into {entry}",
                file=sys.stderr,
                flush=True,
            )
            module = _compile(name, source, tmp, flags, verbose)
            try:
                os.replace(tmp, entry)  # atomic: the entry appears complete or not at all
            except OSError:  # without flock another build may have won the race: same code
                if not _library(entry).exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed build; nothing after the rename
    return module


def load(verbose: bool = False, isa: str | None = None) -> ModuleType:
    """The kernel for ``isa`` (default: this machine's), built first if its entry is missing;
    raises what the build raised (``TimeoutError`` after waiting for another process's build)."""
    entry = entry_dir(isa)
    if not _library(entry).exists():
        module = _build(entry, _flags(isa), verbose)
        if module is not None:
            return module
    return _import(entry.name, _library(entry))


def kernel() -> ModuleType | None:
    """The compiled kernel, or ``None`` (after one warning) where it cannot be had."""
    if "mod" not in _loaded:
        mod = None
        if os.environ.get(DISABLE_ENV, "") in ("", "0"):
            # a bad LSSAR_CPU_KERNEL_ISA or LSSAR_CPU_KERNEL_WAIT is the user's error: raised
            # here, not a fallback
            isa = build_isa()
            _wait_s()
            try:
                mod = load(isa=isa)
            except Exception as exc:  # no compiler, no ninja, a failed build, a held lock
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                fix = (
                    ""
                    if isinstance(exc, TimeoutError)
                    else " Install a C++ compiler and ninja to enable it."
                )
                warnings.warn(
                    f"lssar: the fused CPU attention kernel could not be built "
                    f"({type(exc).__name__}: {first}); impl='cpu' falls back to the eager "
                    f"chunked path (slower, same results).{fix}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _loaded["mod"] = mod
    return _loaded["mod"]


def main() -> None:
    """Build now (``make setup``: ``python -m lssar.ops.cpu.build``) and say whether it is ready."""
    mod = kernel()
    print("lssar: fused CPU kernel", "ready" if mod is not None else "unavailable (eager path)")


if __name__ == "__main__":
    main()
