"""Files of runs and reports: atomic writes and the environment record of an invocation."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch


def atomic_write(
    path: str | Path, data: bytes | memoryview | str | Callable[[BinaryIO], Any]
) -> None:
    """Write ``data`` (bytes, text, or a function writing to a binary file) to ``path`` atomically.

    The content goes to ``.<name>.<pid>.tmp`` beside ``path``, is fsynced, then renamed over
    ``path``: a reader (or a run killed at any moment) sees the old file or the new one, never half.
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
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _git(*args: str) -> str | None:
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
    return r.stdout.strip() if r.returncode == 0 else None


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
CODE_DIRS = ("lssar/", "configs/")


def git_dirty() -> bool | None:
    """Whether the checkout differs from its commit: any change to a tracked file, or an
    untracked file under :data:`CODE_DIRS`. None outside a git checkout."""
    status = _git("status", "--porcelain")
    if status is None:
        return None
    for line in status.splitlines():
        path = line[3:].strip('"')
        if not line.startswith("??") or path.startswith(CODE_DIRS):
            return True
    return False


def environment(device: torch.device | str = "cpu", **extra: Any) -> dict[str, Any]:
    """Code version (git SHA, :func:`git_dirty`), library versions, hardware and command line
    (paths inside the project relative to it)."""
    device = torch.device(device)
    return {
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": git_dirty(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        # torch's vector ISA, and the cpu kernel's build unless LSSAR_CPU_KERNEL_ISA says otherwise
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "argv": [project_relative(a) for a in sys.argv],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }
