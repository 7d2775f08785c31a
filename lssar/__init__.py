"""lssar: Softplus attention with re-weighting (LSSA / LSSAR, arXiv 2501.13428)."""

import importlib.util

# The one place the version is written: pyproject.toml reads it from here (setuptools' `attr`).
__version__ = "0.1.0"

if importlib.util.find_spec("torch") is None:  # not a dependency: the user picks CPU or CUDA
    raise ImportError(
        "lssar needs PyTorch >= 2.5, which is not installed. Install the build for your machine "
        "first: CPU `pip install torch --index-url https://download.pytorch.org/whl/cpu`, CUDA "
        "`pip install torch` (docs/install.md)"
    )

from lssar.ops.registry import attention, variants  # noqa: E402

__all__ = ["attention", "variants", "__version__"]
