"""The old name of :mod:`lssar.ops.triton.devtools.compile_check`, kept so
``python -m lssar.ops.triton.compile_check`` (and old imports) still work: the same module object.
A developer tool, not part of the kernels: nothing of ``impl="triton"`` imports it."""

import sys

from lssar.ops.triton.devtools import compile_check as _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
elif __name__ == "lssar.ops.triton.compile_check":  # imported by name, not as a worker's __main__
    sys.modules[__name__] = _tool
