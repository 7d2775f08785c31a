import os
from collections.abc import Iterator

import pytest
import torch

# The Triton kernels run in the interpreter without a GPU; triton.jit reads the variable when
# triton is first imported (the first impl="triton" call), so it is set before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: intra-op threads buy nothing, and on a busy 2-core machine OpenMP's barriers
    make two threads many times slower than one. Modules opt in with ``usefixtures``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global RNG state, whatever ran before it (a test that
    passes alone passes in any order, on any machine)."""
    torch.manual_seed(0)
