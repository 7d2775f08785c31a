"""ALiBi in the attention op (``alibi_slopes``): the reference is the formula, the SDPA path by
query blocks matches the float64 reference forward and backward within the accuracy rule, never
builds a bias larger than one block, and what cannot take the bias says so."""

from __future__ import annotations

import math

import pytest
import torch

import lssar
from lssar.ops import registry, sdpa
from lssar.ops.registry import resolve
from tests.accuracy import assert_within_rule, err, rounding_sensitivity

BIASABLE = [("softmax", {}), ("ssmax", {"s": 1.3}), ("softmax-qknorm-logn", {})]
SHAPES = [  # (B, H_q, H_kv, T_q, T_k, D), as the attention grid's
    (1, 2, 2, 1, 1, 32),
    (2, 2, 2, 7, 7, 64),
    (1, 2, 2, 63, 63, 100),
    (1, 4, 2, 111, 111, 32),  # GQA
    (2, 2, 1, 5, 19, 32),  # KV cache: T_q < T_k, GQA
]


def _inputs(shape, dtype, seed=0):
    b, hq, hkv, tq, tk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _slopes(shape, per_batch=False, dtype=torch.float64):
    b, hq = shape[0], shape[1]
    s = torch.linspace(0.05, 0.9, hq, dtype=dtype)
    return s.repeat(b, 1) * torch.arange(1, b + 1, dtype=dtype)[:, None] if per_batch else s


def _padding_mask(shape, seed=0):
    b, _, _, tq, tk, _ = shape
    m = torch.rand(b, 1, tq, tk, generator=torch.Generator().manual_seed(seed + 1)) > 0.3
    m[:, :, tq // 2] = False  # one fully masked row
    return m


def _run(q, k, v, grad, **kw):
    out = lssar.attention(q, k, v, **kw)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


def _check_against_reference(variant, opts, shape, mask_kind, per_batch=False):
    causal = mask_kind != "none"
    mask = _padding_mask(shape) if mask_kind == "padding+causal" else None
    kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=shape[1] != shape[2], variant=variant)
    q64, k64, v64 = _inputs(shape, torch.float64)
    s64 = _slopes(shape, per_batch)
    grad = torch.randn(shape[0], shape[1], shape[3], shape[5], dtype=torch.float64)
    golden = _run(q64, k64, v64, grad, impl="reference", alibi_slopes=s64, **kw, **opts)
    sens = rounding_sensitivity(
        lambda q, k, v: _run(q, k, v, grad, impl="reference", alibi_slopes=s64, **kw, **opts),
        (q64, k64, v64),
        golden,
        torch.float32,
    )
    q, k, v = _inputs(shape, torch.float32)
    s32 = s64.float()
    ref = _run(q, k, v, grad.float(), impl="reference", alibi_slopes=s32, **kw, **opts)
    fast = _run(q, k, v, grad.float(), impl="sdpa", alibi_slopes=s32, **kw, **opts)
    assert_within_rule(fast, ref, golden, sens)
    fast64 = _run(q64, k64, v64, grad, impl="sdpa", alibi_slopes=s64, **kw, **opts)
    for f, g in zip(fast64, golden):
        assert err(f, g) < 1e-10 * (g.abs().max().item() + 1.0)


@pytest.mark.parametrize("variant,opts", BIASABLE)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["causal", "none", "padding+causal"])
def test_sdpa_alibi_matches_float64_reference(variant, opts, shape, mask_kind):
    _check_against_reference(variant, opts, shape, mask_kind)


@pytest.mark.parametrize("variant,opts", BIASABLE)
@pytest.mark.parametrize("shape", SHAPES[2:])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "padding+causal"])
def test_sdpa_alibi_in_blocks_of_seven_rows(monkeypatch, variant, opts, shape, mask_kind):
    """Many blocks: every 7th row a block boundary, the causal key cut per block, the
    recomputing backward; with per-(batch, head) slopes."""
    b, hq, _, _, tk, _ = shape
    monkeypatch.setattr(sdpa, "ALIBI_BLOCK_ELEMENTS", 7 * b * hq * tk)
    _check_against_reference(variant, opts, shape, mask_kind, per_batch=True)


def test_reference_is_the_alibi_formula():
    """softmax(q.k / sqrt(d) - m_h |pos_i - j|) written out, causal and not, with T_q < T_k
    (query i at absolute position T_k - T_q + i, FlashAttention's convention)."""
    q, k, v = _inputs((2, 3, 3, 4, 9, 8), torch.float64, seed=3)
    m = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    pos = torch.arange(4)[:, None] + 5  # (T_q, 1)
    dist = (pos - torch.arange(9)[None, :]).abs().double()  # (T_q, T_k)
    logits = q @ k.transpose(-1, -2) / math.sqrt(8) - m[:, None, None] * dist
    for causal in (False, True):
        lg = logits.masked_fill(torch.arange(9) > pos, float("-inf")) if causal else logits
        want = lg.softmax(-1) @ v
        got = lssar.attention(q, k, v, is_causal=causal, variant="softmax", alibi_slopes=m)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    zero = lssar.attention(q, k, v, variant="softmax", alibi_slopes=torch.zeros(3).double())
    torch.testing.assert_close(zero, lssar.attention(q, k, v, variant="softmax"))


@pytest.mark.parametrize("variant,opts", [*BIASABLE, ("softmax", {"p": 15.0})])
def test_reference_gradcheck_with_alibi(variant, opts):
    q, k, v = _inputs((1, 2, 2, 5, 5, 4), torch.float64, seed=4)
    s = torch.tensor([0.3, 0.7], dtype=torch.float64)

    def f(q, k, v):
        kw = dict(variant=variant, impl="reference", alibi_slopes=s, **opts)
        return lssar.attention(q, k, v, is_causal=True, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_kv_cache_rows_get_the_bias_of_the_full_sequence():
    q, k, v = _inputs((1, 2, 2, 24, 24, 16), torch.float64, seed=8)
    s = torch.tensor([0.2, 0.6], dtype=torch.float64)
    for impl in ("reference", "sdpa"):
        full = lssar.attention(
            q, k, v, is_causal=True, variant="softmax", impl=impl, alibi_slopes=s
        )
        for tail in (1, 5):
            part = lssar.attention(
                q[..., -tail:, :], k, v, is_causal=True, variant="softmax", impl=impl,
                alibi_slopes=s,
            )  # fmt: skip
            torch.testing.assert_close(part, full[..., -tail:, :], atol=1e-12, rtol=0)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v = _inputs((1, 2, 2, 5, 5, 8), torch.float64)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    mask[..., 2, :] = False
    s = torch.tensor([0.5, 0.1], dtype=torch.float64)
    out = lssar.attention(q, k, v, mask, variant="softmax", impl="sdpa", alibi_slopes=s)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    out.pow(2).sum().backward()
    assert torch.equal(q.grad[..., 2, :], torch.zeros_like(q.grad[..., 2, :]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_sdpa_bias_never_exceeds_one_block_and_backward_recomputes_it(monkeypatch):
    """At T = 512 with a budget of 8 rows, every bias the path builds is (1, H, <= 8, <= T);
    under autograd each block's bias is built again in the backward (not kept), and the
    gradients equal those of the one-block path."""
    q, k, v = _inputs((1, 2, 2, 512, 512, 16), torch.float32, seed=5)
    s = torch.tensor([0.05, 0.5])
    grad = torch.randn(1, 2, 512, 16)
    one = _run(q, k, v, grad, variant="softmax", impl="sdpa", is_causal=True, alibi_slopes=s)
    shapes = []
    real = sdpa.alibi_bias

    def spy(*a, **kw):
        out = real(*a, **kw)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(sdpa, "alibi_bias", spy)
    monkeypatch.setattr(sdpa, "ALIBI_BLOCK_ELEMENTS", 8 * 2 * 512)
    out = lssar.attention(q, k, v, variant="softmax", impl="sdpa", is_causal=True, alibi_slopes=s)
    n_forward = len(shapes)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    assert n_forward == 512 // 8 and len(shapes) == 2 * n_forward  # rebuilt in the backward
    assert max(h * r * t for _, h, r, t in shapes) <= 8 * 2 * 512
    assert shapes[0] == (1, 2, 8, 8)  # a causal block reads only the keys it can see
    for a, b in zip([out, *grads], one):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_alibi_within_the_rule(dtype):
    shape = (1, 2, 2, 300, 300, 32)
    kw = dict(is_causal=True, variant="softmax")
    q64, k64, v64 = _inputs(shape, torch.float64, seed=6)
    s = torch.tensor([0.02, 0.3], dtype=torch.float64)
    grad = torch.randn(1, 2, 300, 32, dtype=torch.float64)
    golden = _run(q64, k64, v64, grad, impl="reference", alibi_slopes=s, **kw)
    q, k, v = _inputs(shape, dtype, seed=6)
    ref = _run(q, k, v, grad.to(dtype), impl="reference", alibi_slopes=s.float(), **kw)
    fast = _run(q, k, v, grad.to(dtype), impl="sdpa", alibi_slopes=s.float(), **kw)
    assert fast[0].dtype == dtype
    for i, (f, r, g) in enumerate(zip(fast, ref, golden)):
        assert err(f, g) <= (2.0 if i == 0 else 3.0) * err(r, g) + 1e-3, i


def test_auto_routes_alibi_to_the_paths_that_take_it():
    big = torch.empty(1, 1, 256, 8)
    assert resolve("softmax", "auto", big, big, 0.0, {}, alibi=True).impl == "sdpa"
    assert resolve("softmax-qknorm-logn", "auto", big, big, 0.0, {}, alibi=True).impl == "sdpa"
    assert resolve("softmax", "auto", big, big, 0.1, {}, alibi=True).impl == "sdpa"  # dropout
    # re-weighting on top of softmax: only the reference has both
    assert resolve("softmax", "auto", big, big, 0.0, {"p": 15.0}, alibi=True).impl == "reference"
    assert registry.ALIBI_VARIANTS == (
        "softmax",
        "ssmax",
        "softmax-qknorm-logn",
        "softmax-qknorm-const",
        "softmax-qknorm-learned",
    )
    const = resolve("softmax-qknorm-const", "auto", big, big, 0.0, {"n": 128}, alibi=True)
    assert const.impl == "sdpa"


def test_alibi_on_the_constant_scale_variants_matches_the_reference():
    """sdpa folds the frozen scale (and a learned s_h) into q before ALiBi's blocks, as it does
    ln N_i: the same output as the reference's bias on the scaled scores."""
    q, k, v = _inputs((1, 2, 2, 40, 40, 8), torch.float64)
    slopes = torch.tensor([0.25, 0.0625], dtype=torch.float64)
    for name, opts in (
        ("softmax-qknorm-const", {"n": 16}),
        ("softmax-qknorm-learned", {"n": 16, "s": torch.tensor([0.5, 1.5], dtype=torch.float64)}),
    ):
        kw = dict(is_causal=True, variant=name, alibi_slopes=slopes, **opts)
        ref = lssar.attention(q, k, v, impl="reference", **kw)
        assert torch.allclose(lssar.attention(q, k, v, impl="sdpa", **kw), ref, atol=1e-10)
        plain = lssar.attention(q, k, v, impl="reference", is_causal=True, variant=name, **opts)
        assert not torch.allclose(ref, plain, atol=1e-3)


def test_dropout_with_alibi_is_applied():
    q, k, v = _inputs((1, 2, 2, 16, 16, 8), torch.float32)
    s = torch.tensor([0.1, 0.2])
    kw = dict(is_causal=True, variant="softmax", impl="sdpa", alibi_slopes=s)
    assert not torch.allclose(
        lssar.attention(q, k, v, dropout_p=0.5, **kw), lssar.attention(q, k, v, **kw)
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(variant="lssar"), r"alibi_slopes biases the scores of the softmax family \(softmax"),
        (dict(variant="lssa", impl="chunked"), "alibi_slopes biases the scores"),
        (dict(variant="sigmoid"), "variant 'sigmoid' cannot take it"),
        (dict(alibi_slopes=torch.ones(3)), r"shape \(H,\) = \(2,\) or \(B, H\) = \(1, 2\)"),
        (dict(alibi_slopes=torch.ones(2, 2)), r"got \(2, 2\)"),
        (dict(alibi_slopes=torch.ones(2, dtype=torch.long)), "must be a float tensor"),
        (dict(alibi_slopes=[0.5, 0.25]), "must be a float tensor"),
        (dict(alibi_slopes=torch.tensor([0.5, float("nan")])), "must be finite"),
    ],
)
def test_bad_alibi_input(kw, match):
    q = torch.randn(1, 2, 4, 8)
    call = dict(variant="softmax", alibi_slopes=torch.ones(2)) | kw
    with pytest.raises(ValueError, match=match):
        lssar.attention(q, q, q, is_causal=True, **call)


def test_an_impl_without_alibi_names_the_ones_with_it(monkeypatch):
    """A backend that runs softmax but cannot bias it (here: the SDPA entry with ALiBi off)."""
    entry = registry.IMPLS["sdpa"]
    monkeypatch.setitem(registry.IMPLS, "sdpa", type(entry)(**{**entry.__dict__, "alibi": False}))
    monkeypatch.setitem(registry.BACKENDS, "sdpa", registry.IMPLS["sdpa"])
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(
        ValueError, match="impl 'sdpa' cannot apply alibi_slopes; use one of: auto, reference"
    ):
        lssar.attention(q, q, q, variant="softmax", impl="sdpa", alibi_slopes=torch.ones(2))
