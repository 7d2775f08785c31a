"""impl="flex" (FlexAttention) against the reference: forward on CPU (compiled, inference-only).

Every case compiles FlexAttention kernels (seconds each on CPU), so the default run keeps two
small cases; ``-m slow`` adds the rest of the matrix. On CUDA the same cases run with gradients.
"""

import pytest
import torch

from lssar.ops import flex as fx
from lssar.ops import registry
from lssar.ops.reference import reference_attention
from lssar.ops.variants import VARIANTS

pytestmark = pytest.mark.skipif(fx.flex_attention is None, reason="no FlexAttention in torch")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _variant(name, p=None):
    v = VARIANTS[name]
    opts = dict(v.options)
    if "p" in opts:
        opts["p"] = p
    return v, opts


def _rms(err: torch.Tensor) -> float:
    return err.pow(2).mean().sqrt().item()


def _check(
    name, p, shape, mask=None, causal=False, dtype=torch.float32, same_keys=False, **options
):
    """Output (and on CUDA the gradients) within 2x / 3x of the reference's own RMS error."""
    b, hq, hk, tq, tk, d = shape
    variant, opts = _variant(name, p)
    opts.update(options)
    g = torch.Generator().manual_seed(tq * 31 + tk)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, tk, d, generator=g, dtype=torch.float64)
    if same_keys:
        k = k[:, :, :1].expand_as(k).contiguous()
    q, k, v = (t.to(dtype).to(DEVICE) for t in (q, k, v))
    kw = dict(attn_mask=None if mask is None else mask.to(DEVICE), is_causal=causal)
    kw.update(enable_gqa=hq != hk, variant=variant, options=opts)
    grad = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64).to(DEVICE)
    train = DEVICE == "cuda"

    def run(fn, *xs):
        xs = [x.detach().clone().requires_grad_(train) for x in xs]
        with torch.set_grad_enabled(train):
            out = fn(*xs, **kw)
            if not train:
                return [out]
            return [out, *torch.autograd.grad(out, xs, grad.to(out.dtype))]

    gold = run(reference_attention, q.double(), k.double(), v.double())
    ref = run(reference_attention, q, k, v)
    fast = run(fx.flex_attention_impl, q, k, v)
    floor = 1e-6 if dtype == torch.float32 else 1e-4
    for i, (gd, r, f) in enumerate(zip(gold, ref, fast)):
        assert f.dtype == dtype and torch.isfinite(f).all()
        allowed = max((2.0 if i == 0 else 3.0) * _rms(r.double() - gd), floor)
        assert _rms(f.double() - gd) <= allowed, (i, _rms(f.double() - gd), allowed)
    return fast[0]


def _padding_mask(b, tq, tk):
    m = torch.rand(b, 1, tq, tk, generator=torch.Generator().manual_seed(0)) > 0.3
    m[0, 0, tq // 2] = False  # a fully masked row
    return m


def test_lssar_gqa_padding_causal():
    out = _check("lssar", 15.0, (2, 4, 2, 9, 12, 32), _padding_mask(2, 9, 12), causal=True)
    assert (out[0, :, 4] == 0).all()


def test_lssa_kv_cache_causal():
    _check("lssa", None, (1, 2, 2, 5, 19, 32), causal=True)


def test_scale_dim():
    """The ln d ablation (``scale_dim``) reaches flex's length scale."""
    _check("lssar", 15.0, (1, 2, 2, 9, 9, 32), causal=True, scale_dim=128)


@pytest.mark.slow
@pytest.mark.parametrize("p", [3.0, 1.0, 2.5])
def test_lssar_powers(p):
    _check("lssar", p, (1, 2, 2, 33, 33, 100), causal=True)


@pytest.mark.slow
def test_identical_keys_fall_back_to_lssa():
    _check("lssar", 15.0, (1, 1, 1, 8, 8, 32), causal=True, same_keys=True)


@pytest.mark.slow
def test_bf16_and_per_head_mask():
    mask = torch.rand(1, 2, 16, 16, generator=torch.Generator().manual_seed(2)) > 0.4
    _check("lssar", 15.0, (1, 2, 2, 16, 16, 64), mask, dtype=torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-only limitation")
def test_cpu_backward_is_a_clear_error():
    variant, opts = _variant("lssar", 15.0)
    q, k, v = (torch.randn(1, 2, 4, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="inference-only"):
        fx.flex_attention_impl(q, k, v, is_causal=True, variant=variant, options=opts)


def test_registered_for_lssa_lssar_only():
    assert "flex" in registry.IMPLS
    ok = registry.IMPLS["flex"].supports
    assert ok(*_variant("lssa")) and ok(*_variant("lssar", 15.0)) and ok(*_variant("lssar-p3"))
    assert not ok(*_variant("softmax")) and not ok(*_variant("softplus-l1"))
    variant, opts = _variant("lssar", 15.0)
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="dropout"):
        fx.flex_attention_impl(q, q, q, dropout_p=0.1, variant=variant, options=opts)
    with pytest.raises(ValueError, match="scale"):
        fx.flex_attention_impl(q, q, q, scale=0.5, variant=variant, options=opts)
    with pytest.raises(ValueError, match="float64"):  # lssar.attention routes it to chunked
        fx.flex_attention_impl(q.double(), q.double(), q.double(), variant=variant, options=opts)
