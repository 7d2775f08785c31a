"""lssar: Softplus attention with re-weighting (LSSA / LSSAR, arXiv 2501.13428)."""

from lssar.ops.registry import attention, variants

__all__ = ["attention", "variants"]
__version__ = "0.1.0"
