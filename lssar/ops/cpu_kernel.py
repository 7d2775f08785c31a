"""The old name of :mod:`lssar.ops.cpu.build`, kept so ``python -m lssar.ops.cpu_kernel`` and
``from lssar.ops import cpu_kernel`` still work: the same module object (its ``_loaded`` cache
and settings are shared, so patching either name patches both)."""

import sys

from lssar.ops.cpu import build as _build

if __name__ == "__main__":
    _build.main()
elif __name__ == "lssar.ops.cpu_kernel":  # imported by name, not as a worker's __main__
    sys.modules[__name__] = _build
