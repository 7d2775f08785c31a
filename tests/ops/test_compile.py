"""torch.compile over every implementation the registry compiles: fullgraph with a mask, dynamic
shapes, a learnable Scalable-Softmax scale."""

from __future__ import annotations

import pytest
import torch

import lssar
from lssar.ops import registry
from tests.ops.attention_inputs import _inputs

# every impl torch.compile traces (flex compiles itself; triton's interpreter is not compiled)
COMPILED = [i for i in registry.IMPLS if i not in ("flex", "triton")]


def _compiled_matches_eager(fn, compiled, shapes, grad=True):
    for shape in shapes:
        q, k, v = _inputs(shape, torch.float32)
        mask = torch.arange(shape[4]) < torch.tensor([shape[4], shape[4] - 3]).reshape(2, 1, 1, 1)
        with torch.set_grad_enabled(grad):
            out = compiled(q, k, v, mask)
            ref = fn(q, k, v, mask)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
        if not grad:
            continue
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads, ref_grads))


@pytest.fixture
def fresh_dynamo():
    """Each compile test starts from an empty dynamo cache: the tests share one function's code,
    and fullgraph=True turns hitting the recompile limit into an error."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _call(impl):
    name = "lssar" if impl in registry.supporting("lssar") else "ssmax"
    opts = {"p": 3.0} if name == "lssar" else {"s": 1.3}  # float options: symbolic when dynamic

    def fn(q, k, v, mask):
        return lssar.attention(q, k, v, mask, is_causal=True, variant=name, impl=impl, **opts)

    return fn


@pytest.mark.parametrize("impl", COMPILED)
def test_torch_compile_fullgraph_with_a_mask(impl, fresh_dynamo):
    """A masked call is one graph (fullgraph=True raises at a break): nothing in the mask
    handling reads tensor contents on the host."""
    fn = _call(impl)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _compiled_matches_eager(fn, compiled, [(2, 2, 2, 40, 40, 16)])


@pytest.mark.parametrize("impl", COMPILED)
def test_torch_compile_dynamic_shapes(impl, fresh_dynamo):
    """dynamic=True: sizes and float options (p, s) are symbolic. Dynamo's own backend and the
    forward only: what broke was tracing (math.isfinite of a symbolic p), and lowering a
    symbolic graph costs tens of seconds on 2 cores."""
    fn = _call(impl)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
    shapes = [(2, 2, 2, 40, 40, 16), (2, 2, 2, 33, 33, 16)]
    _compiled_matches_eager(fn, compiled, shapes, grad=False)


def test_torch_compile_learnable_ssmax_s(fresh_dynamo):
    """A per-head tensor s (the GPT's learnable one) stays in the graph; a NaN in it is still
    refused, by a check the compiled graph runs (the eager ValueError needs s on the host)."""
    q, k, v = (t.detach() for t in _inputs((1, 2, 2, 20, 20, 16), torch.float32))

    def fn(s):
        return lssar.attention(q, k, v, is_causal=True, variant="ssmax", impl="sdpa", s=s)

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    s = torch.tensor([1.0, 1.3])
    assert torch.allclose(compiled(s), fn(s))
    with pytest.raises(RuntimeError, match="s must be finite"):
        compiled(torch.tensor([1.0, float("nan")]))
