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


@pytest.fixture
def force_dkdv(monkeypatch):
    """A function ``(key_major, one_grad)`` that makes the Triton dk/dv kernel run in that
    formulation (``KEY_MAJOR``, ``ONE_GRAD``: :mod:`lssar.ops.triton.autotune`) for the rest of
    the test: interpreted, through the host's ``INTERPRET_DKDV``; compiled, as the autotuner's
    only config."""

    def force(key_major: bool, one_grad: bool) -> None:
        import triton

        from lssar.ops.triton import autotune, host

        flags = {"KEY_MAJOR": key_major, "ONE_GRAD": one_grad}
        monkeypatch.setattr(host, "INTERPRET_DKDV", flags)
        cfg = triton.Config({"BM": 16, "BN": 64, **flags}, num_warps=4, num_stages=2)
        monkeypatch.setattr(autotune.dkdv_tuned, "configs", [cfg])
        monkeypatch.setattr(autotune.dkdv_tuned, "cache", {})

    return force
