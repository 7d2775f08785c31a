import os

import torch

# The Triton kernels run in the interpreter without a GPU; triton.jit reads the variable when
# triton is first imported (importing lssar imports it), so it is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
