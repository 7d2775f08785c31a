"""The Triton entry as the library reaches it: float64 runs chunked, the precise and TF32 options
follow torch's flags, registered and reachable through lssar.attention, clear errors, torch.compile
fullgraph, opcheck."""

import os

import torch

# triton.jit (also inside triton.language, e.g. tl.zeros) picks compiled or interpreted code when
# a function is decorated: without a GPU the variable must exist before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from lssar.ops import registry  # noqa: E402
from lssar.ops.reference import reference_attention  # noqa: E402
from lssar.ops.variants import VARIANTS  # noqa: E402

pytest.importorskip("triton")

from lssar.ops.triton import host as tk  # noqa: E402
from tests.ops.triton_inputs import DEVICE, _inputs, _variant  # noqa: E402

if DEVICE == "cpu" and not tk._interpreting():
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set (by an earlier test module?): "
        "set it in the environment or in tests/conftest.py, or run this file alone",
        allow_module_level=True,
    )


def test_float64_runs_chunked():
    """lssar.attention routes float64 to impl='chunked'; the kernels themselves refuse it."""
    from lssar import attention

    variant, opts = _variant("lssar", 15.0)
    q, k, v = _inputs(1, 2, 2, 9, 9, 16, torch.float64, seed=8)
    ref = reference_attention(q, k, v, is_causal=True, variant=variant, options=opts)
    fast = attention(q, k, v, is_causal=True, variant="lssar", impl="triton")
    torch.testing.assert_close(fast, ref)
    chunked = attention(q, k, v, is_causal=True, variant="lssar", impl="chunked")
    assert torch.equal(fast, chunked)
    with pytest.raises(ValueError, match="float64"):
        tk.triton_attention(q, k, v, is_causal=True, variant=variant, options=opts)


def test_precise_through_attention():
    """impl_options={"precise": False} reaches the kernels (bf16: one rounding, not a split)."""
    from lssar import attention

    variant, opts = _variant("lssar", 15.0)
    q, k, v = (x.to(DEVICE) for x in _inputs(1, 2, 2, 17, 17, 32, torch.bfloat16, seed=9))
    fast = attention(
        q, k, v, is_causal=True, variant="lssar", impl="triton", impl_options={"precise": False}
    )
    direct = tk.triton_attention(q, k, v, is_causal=True, variant=variant, options=opts,
                                 precise=False)  # fmt: skip
    assert torch.equal(fast, direct)
    precise = attention(q, k, v, is_causal=True, variant="lssar", impl="triton")
    assert not torch.equal(fast, precise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tf32_follows_torch_flag(monkeypatch, dtype):
    """fp32 inputs multiply in IEEE fp32 (``IEEE=True``) unless torch allows TF32: then every
    launch, forward and backward, gets ``IEEE=False`` (Triton's default for fp32 dots: tf32);
    a Triton default other than tf32 keeps IEEE. Half inputs: never IEEE. (TF32 changes the
    numerics on a GPU; the interpreter multiplies in fp32 either way. The compiled kernels'
    tensor-core instructions are checked in tests/ops/test_triton_compile.py.)"""
    from triton import knobs

    variant, opts = _variant("lssar", 15.0)
    q, k, v = _inputs(1, 2, 2, 9, 9, 16, dtype)
    args = (None, True, 2.77, True, True, 15.0, True)

    def flags() -> list[bool]:
        seen = []  # every launch with a matrix product: forward, dq (deterministic), dk/dv
        monkeypatch.setattr(
            tk, "_launch", lambda *a, **kw: "IEEE" in kw and seen.append(kw["IEEE"])
        )
        out, stats, aux = tk._forward(q, k, v, *args)
        tk._backward(torch.zeros_like(out), q, k, v, out, None, stats, aux, *args[1:], True)
        return seen

    fp32 = dtype == torch.float32
    matmul = torch.backends.cuda.matmul  # not a plain attribute: monkeypatch cannot restore it
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert flags() == [fp32] * 3
        matmul.allow_tf32 = True
        assert flags() == [False] * 3
        monkeypatch.setattr(knobs.language, "fp32_default", "ieee")
        assert flags() == [fp32] * 3
    finally:
        matmul.allow_tf32 = before


def test_registered_and_reachable_through_attention():
    from lssar import attention

    assert "triton" in registry.IMPLS
    assert registry.IMPLS["triton"].supports(*_variant("lssar", 15.0))
    assert not registry.IMPLS["triton"].supports(*_variant("softmax"))
    q, k, v = (x.to(DEVICE) for x in _inputs(1, 2, 2, 6, 6, 16, torch.float32))
    torch.testing.assert_close(
        attention(q, k, v, is_causal=True, variant="lssar", impl="triton"),
        attention(q, k, v, is_causal=True, variant="lssar", impl="reference"),
    )


def test_clear_errors(monkeypatch):
    variant, opts = _variant("lssar", 15.0)
    q, k, v = _inputs(1, 1, 1, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="dropout"):
        tk.triton_attention(q, k, v, dropout_p=0.1, variant=variant, options=opts)
    with pytest.raises(ValueError, match="softplus-l1"):
        tk.triton_attention(q, k, v, variant=VARIANTS["softmax"], options={"p": None})
    monkeypatch.setattr(tk, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="needs a CUDA device or TRITON_INTERPRET=1"):
        tk.triton_attention(q, k, v, variant=variant, options=opts)


def test_torch_compile_fullgraph():
    """The custom op keeps a torch.compile graph whole, forward and backward."""
    variant, opts = _variant("lssar", 15.0)
    q, k, v = (x.to(DEVICE).requires_grad_() for x in _inputs(1, 2, 2, 7, 7, 16, torch.float32))

    def f(q, k, v):
        return tk.triton_attention(q, k, v, is_causal=True, variant=variant, options=opts).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(q, k, v).backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    f(q, k, v).backward()
    for a, b in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b)


def test_opcheck():
    q, k, v = (x.to(DEVICE) for x in _inputs(1, 2, 1, 5, 5, 16, torch.float32))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool, device=DEVICE)
    torch.library.opcheck(
        tk.triton_softplus_attention_op,
        (q, k, v, mask, True, 2.77, True, True, 15.0, True),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
