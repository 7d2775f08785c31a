"""The fused CPU kernel's bf16 path: with bf16 q and k (QK-norm variants) Q K^T is computed from
the bf16 inputs on AVX512-BF16 dot products (forward, and the backward's cosines) where the build
and the CPU have them. Held to the float32 kernel and to the accuracy rule of the grids; the
AVX2 build has no such path (its tests skip here and run the float32 kernel)."""

from __future__ import annotations

import pytest
import torch

import lssar
from lssar.ops import chunked
from lssar.ops.cpu import build as cpu_kernel


def _forward_pair(q, k, v, mask=None, causal=True, p=None, h=None):
    """The fused forward of bf16 ``q, k`` (normalised in float32 as impl="cpu" does) and float32
    ``v``, with Q K^T from the bf16 inputs (the AVX512-BF16 path) and from the float32 copies."""
    import math

    from lssar.ops.common import unit

    qn, kn = unit(q.float()), unit(k.float())
    args = (mask, causal, math.log(q.shape[-1]), True, p, 0)
    raw = chunked._fused_call("forward", (qn, kn, v), qn, kn, *args, raw=(q, k))
    f32 = chunked._fused_call("forward", (qn, kn, v), qn, kn, *args)
    return raw[0], f32[0]


def _bf16_dot_or_skip():
    mod = cpu_kernel.kernel()
    if mod is None or not mod.bf16_dot():
        pytest.skip("this build or CPU has no AVX512-BF16 dot products")
    return mod


@pytest.mark.parametrize("p", [None, 15.0, 3.0])
def test_bf16_dot_products_match_the_float32_kernel(p):
    """bf16 q and k: Q K^T from the bf16 inputs (exact products, float32 sums, norms applied
    after) gives the float32 kernel's forward, and its error against float64 stays within 2x the
    float32 reference's own (the accuracy rule of the grids): head dims with pair and lane tails
    (7, 33, 100), odd lengths (1, 7, 63, 111, 257), causal or not, a mask, T_q != T_k."""
    _bf16_dot_or_skip()
    g = torch.Generator().manual_seed(11)
    variant = "lssa" if p is None else "lssar"
    opts = {} if p is None else {"p": p}
    for tq, tk, d in (
        (1, 1, 64),
        (7, 7, 33),
        (63, 63, 100),
        (111, 111, 64),
        (257, 257, 7),
        (37, 90, 32),
        (300, 300, 64),
    ):
        q = torch.randn(2, 3, tq, d, generator=g).bfloat16()
        k = torch.randn(2, 3, tk, d, generator=g).bfloat16()
        v = torch.randn(2, 3, tk, d, generator=g)
        mask = (torch.rand(2, 1, tq, tk, generator=g) > 0.3).expand(2, 3, tq, tk)
        for causal, m in ((True, None), (False, None), (True, mask)):
            raw, f32 = _forward_pair(q, k, v, m, causal, p)
            kw = {"is_causal": causal, "variant": variant, "impl": "reference", **opts}
            exact = lssar.attention(q.double(), k.double(), v.double(), m, **kw)
            own = lssar.attention(q.float(), k.float(), v, m, **kw)  # the reference in float32
            assert torch.allclose(raw, f32, rtol=1e-4, atol=1e-4 * f32.abs().max().item())
            err_raw, err_own = ((x.double() - exact).abs().max().item() for x in (raw, own))
            floor = 2**-23 * v.abs().max().item()  # one-key rows: exact in float64, 1 ulp here
            assert err_raw <= 2 * max(err_own, floor), (tq, tk, d, causal, m is not None)


@pytest.mark.parametrize("p", [None, 15.0, 3.0])
def test_bf16_dot_products_in_the_backward(p):
    """The backward's cosines from the bf16 inputs: the float32 kernel's gradients, and errors
    against float64 (the eager path on float64 copies) within 3x those of the eager path in
    float32 (the gradients' rule), on the shapes of the forward's test."""
    import math

    from lssar.ops.common import unit

    _bf16_dot_or_skip()
    g = torch.Generator().manual_seed(15)
    for tq, tk, d in ((1, 1, 64), (7, 7, 33), (63, 63, 100), (257, 257, 7), (37, 90, 32)):
        q = torch.randn(2, 3, tq, d, generator=g).bfloat16()
        k = torch.randn(2, 3, tk, d, generator=g).bfloat16()
        v = torch.randn(2, 3, tk, d, generator=g)
        grad = torch.randn(2, 3, tq, d, generator=g)
        mask = (torch.rand(2, 1, tq, tk, generator=g) > 0.3).expand(2, 3, tq, tk)
        qn, kn = unit(q.float()), unit(k.float())
        for causal, m in ((True, None), (False, None), (True, mask)):
            args = (m, causal, math.log(d), True, p, 0)
            tensors = (grad, qn, kn, v)
            raw = chunked._fused_call("backward", tensors, qn, kn, *args, raw=(q, k))
            f32 = chunked._fused_call("backward", tensors, qn, kn, *args)
            wide = (grad.double(), unit(q.double()), unit(k.double()), v.double())
            exact = chunked.softplus_attention_backward_op(*wide, *args, False)
            own = chunked.softplus_attention_backward_op(*tensors, *args, False)
            for a, b, x, o in zip(raw, f32, exact, own):
                assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())
                err, err_own = ((y.double() - x).abs().max().item() for y in (a, o))
                floor = 2**-23 * x.abs().max().item()
                assert err <= 3 * max(err_own, floor), (tq, tk, d, causal, m is not None)


def test_bf16_dot_products_keep_every_scale_and_fall_back_on_non_finite_rows():
    """Rows scaled by 2^100 or 2^-120 (products beyond float32's range or below its normal one
    unless each row is scaled first), zero rows (zero scores) and rows holding a NaN or an
    infinity (the kernel reports them, the host reruns the float32 path: its NaNs exactly)."""
    _bf16_dot_or_skip()
    g = torch.Generator().manual_seed(12)
    q, k = (torch.randn(1, 2, 70, 40, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 2, 70, 40, generator=g)
    q[0, 0, 3] *= 2.0**100
    k[0, 0, 5] *= 2.0**100
    q[0, 1, 7] *= 2.0**-120
    k[0, 1, 9] *= 2.0**-120
    q[0, 0, 11] = 0
    k[0, 1, 13] = 0
    raw, f32 = _forward_pair(q, k, v, p=15.0)
    assert raw.isfinite().all()
    assert torch.allclose(raw, f32, rtol=1e-4, atol=1e-4 * f32.abs().max().item())
    k[0, 1, 20, 3] = float("nan")
    q[0, 0, 30, 0] = float("inf")
    raw, f32 = _forward_pair(q, k, v, p=15.0)
    assert raw.isnan().any() and torch.equal(raw.isnan(), f32.isnan())
    assert torch.equal(raw.nan_to_num(0.0), f32.nan_to_num(0.0))  # the same call, rerun
    mod = cpu_kernel.kernel()
    from lssar.ops.common import REWEIGHT_MIN_KEYS, uniform_tolerance, unit

    qn, kn = unit(q.float()), unit(k.float())
    rule = (15.0, float(REWEIGHT_MIN_KEYS), uniform_tolerance(torch.float32))
    args = (torch.randn(v.shape), qn, kn, v, None, 2, True, 4.0, True, *rule, 32)
    assert mod.backward(*args, q, k)[-1] == 2  # reported: the host reruns without them
    assert mod.backward(*args, None, None)[-1] == 0


def test_bf16_inputs_take_the_bf16_dot_path(monkeypatch):
    """impl="cpu" hands the forward the bf16 query and key (expanded for GQA) where the kernel
    has the dot products, never on float32 inputs, documents or with chunked.BF16_DOT off; the
    results stay those of the float32 path (the output rounded to bf16)."""
    _bf16_dot_or_skip()
    seen = []
    real = chunked._fused_call
    monkeypatch.setattr(
        chunked,
        "_fused_call",
        lambda *a, raw=None, **kw: seen.append(raw) or real(*a, raw=raw, **kw),
    )
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 4, 45, 33, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 45, 33, generator=g).bfloat16() for _ in range(2))
    kw = {"is_causal": True, "variant": "lssar", "impl": "cpu", "enable_gqa": True}
    out = lssar.attention(q, k, v, **kw)
    assert len(seen) == 1 and seen[0] is not None and seen[0][1].shape == (1, 4, 45, 33)
    monkeypatch.setattr(chunked, "BF16_DOT", False)
    ref = lssar.attention(q, k, v, **kw)
    assert seen[-1] is None
    assert (out.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max()
    seen.clear()
    monkeypatch.setattr(chunked, "BF16_DOT", True)
    lssar.attention(q.float(), k.float(), v.float(), **kw)
    assert seen == [None]


@pytest.mark.parametrize("p", [None, 15.0])
def test_bf16_key_tiles_add_up(p):
    """The bf16 path's key tiles (slabs of packed pairs, each key's norm) give the one-tile
    result, and its backward's row blocks the one-block gradients, with a mask, causal,
    T_q != T_k and an odd head dim."""
    from lssar.ops.common import REWEIGHT_MIN_KEYS, uniform_tolerance, unit

    mod = _bf16_dot_or_skip()
    g = torch.Generator().manual_seed(14)
    b, h, tq, tk, d = 2, 3, 37, 53, 17
    qb = torch.randn(b, h, tq, d, generator=g).bfloat16()
    kb = torch.randn(b, h, tk, d, generator=g).bfloat16()
    q, k = unit(qb.float()), unit(kb.float())
    v = torch.randn(b, h, tk, d, generator=g)
    mask = (torch.rand(b, 1, tq, tk, generator=g) > 0.3).expand(b, h, tq, tk)
    rule = (-1.0 if p is None else p, float(REWEIGHT_MIN_KEYS), uniform_tolerance(torch.float32))
    args = (mask, h, True, 4.16, True, *rule, 16)
    whole, s1 = mod.forward(q, k, v, *args, tk, qb, kb)
    tiled, s2 = mod.forward(q, k, v, *args, 16, qb, kb)
    f32, s3 = mod.forward(q, k, v, *args, tk, None, None)
    assert s1 == s2 == s3 == 0
    assert torch.allclose(tiled, whole, rtol=1e-5, atol=1e-6)
    assert torch.allclose(whole, f32, rtol=1e-4, atol=1e-5)
    grad = torch.randn(b, h, tq, d, generator=g)  # the backward's row blocks, from the same pairs
    args = (grad, q, k, v, mask, h, True, 4.16, True, *rule)
    *one, s1 = mod.backward(*args, tq, qb, kb)
    *f32, s3 = mod.backward(*args, tq, None, None)
    for rows in (7, chunked.FUSED_CAUSAL_ROWS):
        *blocks, s2 = mod.backward(*args, rows, qb, kb)
        assert s1 == s2 == s3 == 0
        for a, w, f in zip(blocks, one, f32):
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-6 * w.abs().max().item())
            assert torch.allclose(w, f, rtol=1e-3, atol=1e-4 * f.abs().max().item())


def test_the_avx2_build_has_no_bf16_dot_products():
    if "AVX2" not in cpu_kernel.runnable_isas():
        pytest.skip("this machine runs no AVX2 build")
    assert cpu_kernel.load(isa="AVX2").bf16_dot() is False
