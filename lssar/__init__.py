"""lssar: Softplus attention with re-weighting (LSSA / LSSAR, arXiv 2501.13428).

``lssar.attention`` and ``lssar.variants`` load the library (and torch) on first use, so the
``lssar`` command can set OpenMP's environment before torch starts (:mod:`lssar.cli`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["attention", "variants"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lssar.ops import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'lssar' has no attribute {name!r}")
