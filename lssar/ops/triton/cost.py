"""The old name of :mod:`lssar.ops.triton.devtools.cost`, kept so
``python -m lssar.ops.triton.cost`` (and old imports) still work: the same module object.
A developer tool, not part of the kernels: nothing of ``impl="triton"`` imports it."""

import sys

from lssar.ops.triton.devtools import cost as _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
elif __name__ == "lssar.ops.triton.cost":  # imported by name, not as a worker's __main__
    sys.modules[__name__] = _tool
