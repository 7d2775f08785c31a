"""Files of runs, datasets and reports: atomic writes, directory locks, names that stay inside
their parent, and the environment record of an invocation.

Every writer of a run or dataset directory goes through :func:`atomic_write` (a reader sees the
old file or the new one, never half of one; a full disk is :class:`DiskFullError`, with the old
file intact) and holds the directory's :func:`exclusive_lock` (one writer at a time; the lock
dies with its process). Failures of the environment rather than of the input (a held lock, a
full disk) are :class:`RunFailure`: the CLI prints them as one ``error:`` line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pickle
import platform
import re
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch


class RunFailure(Exception):
    """A failure of the environment, not of the input (a held lock, a full disk, a diverged
    run): the CLI prints it as one ``error:`` line and exits with 1."""


class LockedError(RunFailure):
    """The directory is locked by another live process (named in the message)."""


class DiskFullError(RunFailure, OSError):
    """No space (or quota) left while writing a file; the file's previous version is intact."""

    def __str__(self) -> str:
        return str(self.strerror)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# atomic_write's temp files: ".<name>.<pid>.tmp"
TEMP_FILE = re.compile(r"^\..+\.\d+\.tmp$")


def atomic_write(
    path: str | Path, data: bytes | memoryview | str | Callable[[BinaryIO], Any]
) -> None:
    """Write ``data`` (bytes, text, or a function writing to a binary file) to ``path`` atomically.

    The content goes to ``.<name>.<pid>.tmp`` beside ``path``, is fsynced, then renamed over
    ``path``: a reader (or a run killed at any moment) sees the old file or the new one, never half.
    A full disk raises :class:`DiskFullError` (the temp file removed, ``path`` unchanged); a
    temp file left by a killed writer is removed by :func:`remove_stale_temps`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if no_space(e):
            raise disk_full(path) from e
        raise


def no_space(e: BaseException | None) -> bool:
    """Whether ``e``, or an error it was raised from (``torch.save`` turns the ``OSError`` of a
    full disk into a ``RuntimeError``), is a full disk or quota."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def disk_full(path: str | Path) -> DiskFullError:
    """The error for a write to ``path`` that found no space left."""
    return DiskFullError(
        errno.ENOSPC,
        f"no space left on the device writing {path} (its previous version, if any, is "
        "intact): free some space and run the same command again",
    )


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Delete the temp files of :func:`atomic_write` in ``directory`` (not below it), which a
    writer killed mid-write leaves behind (a checkpoint-sized one, for a checkpoint). Call it only
    while holding the directory's :func:`exclusive_lock`: then no live writer owns one."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if TEMP_FILE.match(p.name) and p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut at ``limit`` characters."""
    s = " ".join(str(e).split()) or type(e).__name__
    return s if len(s) <= limit else s[:limit] + "..."


def load_data(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load`` of a file read back from disk, as data only (``weights_only``: tensors,
    numbers, strings, lists, tuples and dicts): a planted pickle cannot run code. A file that is
    not such data is a ``ValueError`` saying why, in one line (for the caller's message)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # what weights_only refuses: a class, a function call
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f" ({found[1]})" if found else ""
        raise ValueError(
            f"it holds Python objects{what}, not only tensors and plain data; it was not loaded, "
            "as loading it could run code"
        ) from e
    except Exception as e:  # a damaged file: RuntimeError, EOFError, ...
        raise ValueError(one_line(e)) from e


# ----------------------------------------------------------------------------------- locks

LOCK_FILE = ".lock"
_HELD: set[str] = set()  # lock files this process holds (a second take would wait on itself)


def _holder(path: Path) -> str:
    """Who holds the lock at ``path``, from what the holder wrote into it."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process"
    since = f", since {info['since']}" if info.get("since") else ""
    return f"pid {info['pid']} on host {info.get('host', '?')}{since}"


@contextlib.contextmanager
def exclusive_lock(directory: str | Path, what: str, wait: bool = False) -> Iterator[Path]:
    """Hold ``directory``'s lock (``directory/.lock``, created with the directory) for the block.

    The lock is an ``flock`` on that file, so the kernel drops it when its holder exits or is
    killed: a lock left by a dead process is taken over, never waited on. The holder writes its
    pid, host and start time into the file, so a refused caller is told who holds it. A held
    lock raises :class:`LockedError` (``wait=False``), or is waited for with a message naming the
    holder (``wait=True``). ``what`` names the directory in messages (``"run"``, ``"dataset"``).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    key = str(path.resolve())
    if key in _HELD:
        raise LockedError(f"{what} {directory} is already locked by this process ({os.getpid()})")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(path)
            if not wait:
                raise LockedError(
                    f"{what} {directory} is in use by {holder}: wait for it to finish, or stop "
                    f"it (a lock whose process has exited is taken over)"
                ) from None
            print(f"waiting for {holder}, which holds {what} {directory}", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _HELD.add(key)
        try:
            yield path
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)  # releases the flock


# ----------------------------------------------------------------------------------- names


def child_path(parent: str | Path, name: str, what: str) -> Path:
    """``parent / name`` for a ``name`` that is one plain path component (no separator, not
    ``.`` or ``..``, not absolute), so that what is written there stays inside ``parent``.
    ``what`` names the setting in the error (``"--run_name"``)."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name != name.strip()
    ):
        raise ValueError(
            f"{what}={name!r} must be a plain name (no '/', '..' or surrounding spaces): it "
            f"names a folder inside {parent}"
        )
    return Path(parent) / name


def _git(*args: str, strip: bool = True) -> str | None:  # in the package's directory
    try:
        r = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return r.stdout.strip() if strip else r.stdout


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def project_relative(arg: str) -> str:
    """``arg`` (or the value of ``--flag=arg``) relative to the project when it is an absolute
    path inside it, so that records do not depend on where the project was cloned."""
    flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    if not eq:
        flag, value = "", arg
    path = Path(value)
    if path.is_absolute():
        for p in (path, path.resolve()):
            with contextlib.suppress(ValueError):
                return flag + eq + str(p.relative_to(PROJECT_ROOT))
    return arg


# untracked files here can change results; elsewhere (new reports, notes) they cannot
CODE_DIRS = ("lssar/",)
# what the studies write: a regenerated report (tracked or not) cannot change results
OUTPUT_DIRS = ("reports/",)


def in_checkout() -> bool:
    """Whether this lssar runs from its own git checkout (an editable install, or the source
    on ``sys.path``): not from a wheel, whose site-packages may lie inside some other repository
    whose commit says nothing about this code."""
    top = _git("rev-parse", "--show-toplevel")
    return top is not None and Path(top).resolve() == PROJECT_ROOT.resolve()


def git_dirty() -> bool | None:
    """Whether the checkout differs from its commit: any change to a tracked file outside
    :data:`OUTPUT_DIRS`, or an untracked file under :data:`CODE_DIRS`. None outside a git
    checkout."""
    if not in_checkout():
        return None
    # unstripped: a porcelain line is "XY path", and X may be a space
    status = _git("status", "--porcelain", strip=False)
    if status is None:
        return None
    for line in filter(None, status.splitlines()):
        path = line[3:].strip('"')
        if path.startswith(OUTPUT_DIRS):
            continue
        if not line.startswith("??") or path.startswith(CODE_DIRS):
            return True
    return False


def install_kind() -> str:
    """How the running lssar is installed: ``"editable"`` (``pip install -e``, this source),
    ``"wheel"`` (a built wheel in site-packages, from an index or a file) or ``"source"`` (a
    directory on ``sys.path`` that is no installed distribution, e.g. a checkout that shadows
    one installed elsewhere)."""
    here = Path(__file__).resolve().parent
    dists = list(metadata.distributions(name="lssar"))
    if not dists:
        return "source"
    # a checkout's build leftover (lssar.egg-info, found through the working directory on
    # sys.path under `python -m`) comes first and has no direct_url.json: the installed
    # distribution that has one says how lssar was installed
    dist = next((d for d in dists if d.read_text("direct_url.json")), dists[0])
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")  # PEP 610
    except ValueError:
        direct = {}
    if direct.get("dir_info", {}).get("editable"):
        src = Path(urllib.parse.unquote(urllib.parse.urlparse(direct.get("url", "")).path))
        return "editable" if (src / "lssar").resolve() == here else "source"
    installed = Path(str(dist.locate_file("lssar/__init__.py"))).resolve()
    return "wheel" if installed == here / "__init__.py" else "source"


# /proc/cpuinfo flags that decide which kernels run (vector and matrix ISAs): what makes bf16 and
# BLAS results move from host to host
_ISA_FLAGS = ("sse", "ssse", "avx", "amx", "fma", "f16c", "vnni")


def cpu_info() -> dict[str, Any]:
    """``{"cpu_model", "cpu_flags"}``: the CPU's model name and its vector/matrix ISA flags
    (sorted; from ``/proc/cpuinfo``, where there is one)."""
    model, flags = platform.processor() or platform.machine(), []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = sorted(f for f in value.split() if f.startswith(_ISA_FLAGS))
                break
    return {"cpu_model": model, "cpu_flags": " ".join(flags)}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16/AMX): else bf16 matmuls are emulated,
    often ~100x slower than fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # a build without oneDNN, or the private op moved
        return False


def auto_autocast(device: torch.device | str) -> str:
    """What ``dtype="auto"`` resolves to on ``device``: ``"bf16"`` autocast where it is native
    (CUDA with bf16, a CPU with AVX512-BF16/AMX), else ``"fp32"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"


def environment(
    device: torch.device | str = "cpu", autocast: str | None = None, **extra: Any
) -> dict[str, Any]:
    """Code version (lssar's version and install kind; from a checkout the git SHA and
    :func:`git_dirty`), library versions, hardware (:func:`cpu_info`, the device, what
    ``dtype="auto"`` resolves to there, and ``autocast``, the dtype the caller runs under, when
    given) and command line (paths inside the project relative to it)."""
    import lssar

    device = torch.device(device)
    checkout = in_checkout()
    cpu = cpu_info()
    return {
        "lssar": lssar.__version__,
        "install": install_kind(),
        "git_sha": _git("rev-parse", "HEAD") if checkout else None,
        "git_dirty": git_dirty(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else cpu["cpu_model"],
        **cpu,
        # torch's vector ISA, and the cpu kernel's build unless LSSAR_CPU_KERNEL_ISA says otherwise
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "autocast_auto": auto_autocast(device),
        **({"autocast": autocast} if autocast is not None else {}),
        "threads": torch.get_num_threads(),
        "argv": [project_relative(a) for a in sys.argv],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }
