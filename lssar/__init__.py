"""lssar: Softplus attention with re-weighting (LSSA / LSSAR, arXiv 2501.13428).

``lssar.attention`` and ``lssar.variants`` load the library (and torch) on first use, so the
``lssar`` command can set OpenMP's environment before torch starts (:mod:`lssar.cli`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["attention", "variants"]
# The one place the version is written: pyproject.toml reads it from here (setuptools' `attr`).
__version__ = "0.1.0"

# torch is not a dependency (the user picks the CPU or CUDA build); found, not imported, here
if importlib.util.find_spec("torch") is None:
    raise ImportError(
        "lssar needs PyTorch >= 2.5, which is not installed. Install the build for your machine "
        "first: CPU `pip install torch --index-url https://download.pytorch.org/whl/cpu`, CUDA "
        "`pip install torch` (docs/install.md)"
    )


def __getattr__(name: str) -> Any:
    if name == "attention":
        from lssar.ops.api import attention

        return attention
    if name == "variants":
        from lssar.ops.registry import variants

        return variants
    raise AttributeError(f"module 'lssar' has no attribute {name!r}")
