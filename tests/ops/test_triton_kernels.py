"""The Triton kernels (impl="triton") against the reference, forward and backward.

Without CUDA the kernels run in the Triton interpreter on CPU tensors (slow: shapes stay small);
with CUDA the same matrix runs compiled, and the ``gpu``-marked tests add long sequences.
Errors (RMS) are measured against a float64 run of the reference on the same (rounded) inputs:
the fast path must stay within 2x (output) / 3x (gradients) of the reference's own error in the
same dtype, with an absolute floor so that exact-zero errors compare sanely.
"""

import functools
import math
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lssar.ops.triton import host as tk  # noqa: E402
from lssar.ops.triton.kernels import _softplus_sigmoid  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not tk._interpreting():
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set (by an earlier test module?): "
        "set it in the environment or in tests/conftest.py, or run this file alone",
        allow_module_level=True,
    )
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5}


def _variant(name: str, p: float | None = None):
    v = VARIANTS[name]
    opts = dict(v.options)
    if "p" in opts:
        opts["p"] = p
    return v, opts


def _inputs(b, hq, hk, tq, tk, d, dtype, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, dv or d))
    # round to the test dtype once, so golden and fast paths see identical inputs
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _rms(err: torch.Tensor) -> float:
    # RMS rather than max: a max over a few sharpened (p = 15) entries is too noisy a statistic
    # for a 2x bound, while any real bug (a wrong row, a wrong term) moves the RMS by orders.
    return err.pow(2).mean().sqrt().item() if err.numel() else 0.0


def _run(fn, q, k, v, grad, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    return out, dq, dk, dv


def _check(name, p, q, k, v, mask=None, causal=False, gqa=False, grads=True, mult=(2.0, 3.0),
           **fast_kw):  # fmt: skip
    """Fast vs reference error (both vs the float64 reference) for out and dq, dk, dv."""
    variant, opts = _variant(name, p)
    dtype = q.dtype
    kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=gqa, variant=variant, options=opts)
    g = torch.Generator().manual_seed(123)
    grad = torch.randn(q.shape[:-1] + v.shape[-1:], generator=g, dtype=torch.float64)
    dev = [x.to(DEVICE) for x in (q, k, v, grad)]
    if mask is not None:
        kw["attn_mask"] = mask.to(DEVICE)
    gold = _run(reference_attention, *(x.double() for x in dev[:3]), dev[3], **kw)
    ref = _run(reference_attention, *dev, **kw)
    fast = _run(functools.partial(tk.triton_attention, **fast_kw), *dev, **kw)
    labels = ("out", "dq", "dk", "dv") if grads else ("out",)
    for label, gd, r, f in zip(labels, gold, ref, fast):
        assert f.dtype == dtype and f.shape == gd.shape, label
        assert torch.isfinite(f).all(), label
        ref_err = _rms(r.double() - gd)
        fast_err = _rms(f.double() - gd)
        allowed = max(mult[label != "out"] * ref_err, FLOOR[dtype])
        assert fast_err <= allowed, (
            f"{label}: fast {fast_err:.3g} > {allowed:.3g} (ref {ref_err:.3g})"
        )
    return fast


CASES = [("lssa", None), ("lssar", 15.0), ("lssar", 3.0), ("lssar", 1.0), ("lssar", 2.5)]


@pytest.mark.parametrize("t,d", [(1, 32), (7, 16), (33, 100)])
@pytest.mark.parametrize("name,p", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_fp32(t, d, name, p, causal):
    q, k, v = _inputs(2, 2, 2, t, t, d, torch.float32, seed=t + d)
    _check(name, p, q, k, v, causal=causal)


@triton.jit
def _softplus_probe(T, SP, SG, BLOCK: tl.constexpr, POLY: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    sp, sg = _softplus_sigmoid(tl.load(T + offs), POLY)
    tl.store(SP + offs, sp)
    tl.store(SG + offs, sg)


@pytest.mark.parametrize("poly,bound", [(8, 6 * 2.0**-24), (6, 2e-6), (5, 1e-5)])
def test_softplus_device_function_accuracy(poly, bound):
    # The kernels' softplus in base 2 (log2(1 + 2^t) for t = s log2 e: exp2 and a polynomial
    # log2(1 + u) of degree POLY) and sigmoid(s), element-wise against float64, over the scores
    # lssa/lssar reach (|s| <= ln d ln N, |t| <= 1.45 |s|) and beyond, tiny |t| included: within
    # a few ulp for the fp32 degree (8), within the fit's error for the half-precision ones
    # (6 with precise=True, 5 without: lssar.ops.triton.host._poly). The sigmoid does not
    # depend on the degree.
    mag = torch.cat(
        [torch.linspace(0, 124, 8000, dtype=torch.float64), 10.0 ** torch.linspace(-8, 1, 192)]
    )
    t = torch.cat([mag, -mag]).float().to(DEVICE)
    sp, sg = torch.empty_like(t), torch.empty_like(t)
    _softplus_probe[(t.numel() // 128,)](t, sp, sg, BLOCK=128, POLY=poly)
    t64 = t.double().cpu()
    want_sp = torch.nn.functional.softplus(t64 * math.log(2)) / math.log(2)
    want_sg = torch.sigmoid(t64 * math.log(2))
    for got, want, tol in ((sp, want_sp, bound), (sg, want_sg, 6 * 2.0**-24)):
        rel = (got.double().cpu() - want).abs() / want
        bad = rel > tol
        assert not bad.any(), (t64[bad][:5].tolist(), rel[bad][:5].tolist())
    with pytest.raises(AssertionError):  # the bound can fail: the next lower degree misses it
        if poly > 5:
            _softplus_probe[(t.numel() // 128,)](t, sp, sg, BLOCK=128, POLY=5)
            assert ((sp.double().cpu() - want_sp).abs() / want_sp <= bound).all()
        else:
            assert ((sp.double().cpu() - want_sp).abs() / want_sp <= bound / 10).all()


@pytest.mark.parametrize("scale", [None, 2.0])
def test_softplus_l1_sdpa_scaling(scale):
    variant, opts = _variant("softplus-l1")
    q, k, v = _inputs(1, 2, 2, 19, 19, 32, torch.float32, seed=5)
    gold = reference_attention(q.double(), k.double(), v.double(), scale=scale,
                               variant=variant, options=opts)  # fmt: skip
    ref = reference_attention(q, k, v, scale=scale, variant=variant, options=opts)
    fast = tk.triton_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), scale=scale,
                               variant=variant, options=opts).cpu()  # fmt: skip
    assert (fast.double() - gold).abs().max() <= max(2 * (ref.double() - gold).abs().max(), 1e-6)
    with pytest.raises(AssertionError):  # the scale is really used
        torch.testing.assert_close(fast, tk.triton_attention(
            q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), scale=7.0, variant=variant, options=opts
        ).cpu())  # fmt: skip


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0)])
def test_gqa_causal(name, p):
    q, k, v = _inputs(1, 4, 2, 21, 21, 32, torch.float32, seed=3)
    _check(name, p, q, k, v, causal=True, gqa=True)


# the dk/dv kernel's formulations for sm_90's wgmma (KEY_MAJOR: scores as k q^T; ONE_GRAD: one
# program for dk and one for dv per key block), forced (the GPU's autotuner picks them by timing)
WGMMA_DKDV = [(True, False), (True, True), (False, True)]


@pytest.mark.parametrize("key_major,one_grad", WGMMA_DKDV)
def test_wgmma_dkdv_formulations(force_dkdv, key_major, one_grad):
    force_dkdv(key_major, one_grad)
    q, k, v = _inputs(1, 4, 2, 21, 21, 32, torch.float32, seed=3)
    _check("lssar", 15.0, q, k, v, causal=True, gqa=True)  # GQA: a key head's query heads
    _check("lssa", None, q, k, v, causal=True, gqa=True)
    q, k, v = _inputs(2, 2, 2, 9, 12, 32, torch.float32, seed=11)
    mask = torch.rand(2, 1, 9, 12, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[0, 0, 4] = False  # a fully masked row
    _check("lssar", 15.0, q, k, v, mask=mask)
    q, k, v = _inputs(1, 2, 2, 33, 33, 64, torch.bfloat16, seed=4)  # the hi + lo products
    _check("lssar", 15.0, q, k, v, causal=True)


def test_one_grad_needs_both_programs_of_a_key_block(force_dkdv, monkeypatch):
    """The check above can fail: ONE_GRAD on a grid that the host did not double leaves half the
    dk/dv programs unlaunched."""
    force_dkdv(True, True)
    monkeypatch.setattr(tk, "_programs_per_block", lambda meta: 1)
    q, k, v = _inputs(1, 4, 2, 21, 21, 32, torch.float32, seed=3)
    with pytest.raises(AssertionError, match="dq|dk|dv"):  # dq: added by the dk programs
        _check("lssar", 15.0, q, k, v, causal=True, gqa=True)


@pytest.mark.parametrize("tq,tk", [(5, 19), (19, 5)])
@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0)])
def test_kv_cache_bottom_right_causal(tq, tk, name, p):
    """T_q != T_k: query t sits at T_k - T_q + t; for T_q > T_k the first rows see nothing."""
    q, k, v = _inputs(1, 2, 2, tq, tk, 32, torch.float32, seed=tq)
    out = _check(name, p, q, k, v, causal=True)[0]
    if tq > tk:
        assert (out[:, :, : tq - tk] == 0).all()


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0), ("lssar", 1.0)])
def test_padding_mask_with_empty_row(name, p):
    q, k, v = _inputs(2, 2, 2, 9, 12, 32, torch.float32, seed=11)
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 1, 9, 12, generator=g) > 0.3
    mask[0, 0, 4] = False  # a fully masked row: zeros and zero gradients, never NaN
    mask[1, 0, 2, :2] = True  # small-N rows
    mask[1, 0, 2, 2:] = False
    out, dq, _, _ = _check(name, p, q, k, v, mask=mask)
    assert (out[0, :, 4] == 0).all() and (dq[0, :, 4] == 0).all()


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0)])
def test_key_padding_with_causal_and_per_head_mask(name, p):
    q, k, v = _inputs(2, 2, 2, 16, 16, 32, torch.float32, seed=12)
    keep = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    keep[1, ..., 11:] = False  # right padding of the second sequence
    _check(name, p, q, k, v, mask=keep, causal=True)
    per_head = torch.rand(2, 2, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.5
    _check(name, p, q, k, v, mask=per_head)


def test_identical_keys_fall_back_to_lssa():
    """Every x_ij = 0 (all visible Softplus values equal): the LSSA weights, here uniform."""
    q, k, v = _inputs(1, 1, 1, 8, 8, 32, torch.float32, seed=2)
    k = k[:, :, :1].expand_as(k).contiguous()
    out = _check("lssar", 15.0, q, k, v, causal=True)[0]
    uniform = torch.cumsum(v[0, 0], 0) / torch.arange(1, 9).unsqueeze(-1)
    torch.testing.assert_close(out[0, 0].cpu(), uniform, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0), ("lssar", 3.0)])
def test_bf16(name, p):
    q, k, v = _inputs(1, 2, 2, 33, 33, 64, torch.bfloat16, seed=4)
    _check(name, p, q, k, v, causal=True)


def test_fp16():
    q, k, v = _inputs(1, 2, 2, 20, 20, 32, torch.float16, seed=13)
    _check("lssar", 15.0, q, k, v, causal=True)


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0)])
def test_bf16_fast_rounding(name, p):
    """precise=False rounds weights once for the MMAs (FlashAttention grade): a looser bound."""
    q, k, v = _inputs(1, 2, 2, 33, 33, 64, torch.bfloat16, seed=4)
    _check(name, p, q, k, v, causal=True, mult=(4.0, 4.0), precise=False)


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0)])
def test_deterministic_backward(name, p):
    """deterministic=True: dq from its own kernel (no atomics), held to the same rule as the
    default (half precision: dq added in the dk/dv kernel with atomics); the two agree to
    rounding (fp32 inputs always take the dq kernel)."""
    q, k, v = _inputs(1, 4, 2, 21, 21, 32, torch.bfloat16, seed=3)
    det = _check(name, p, q, k, v, causal=True, gqa=True, deterministic=True)
    fused = _check(name, p, q, k, v, causal=True, gqa=True)
    for a, b in zip(det, fused):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    q, k, v = _inputs(2, 2, 2, 9, 12, 32, torch.bfloat16, seed=11)
    mask = torch.rand(2, 1, 9, 12, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[0, 0, 4] = False  # a fully masked row
    _check(name, p, q, k, v, mask=mask, deterministic=True)


def test_inference_forward_skips_the_backward_vectors():
    """Without a gradient to record the LSSAR forward keeps no F_i vectors (FOLD_F off): the
    same output, an empty aux, and a backward from it refuses clearly."""
    variant, opts = _variant("lssar", 15.0)
    q, k, v = (x.to(DEVICE) for x in _inputs(1, 2, 2, 33, 33, 32, torch.float32, seed=5))
    kw = dict(is_causal=True, variant=variant, options=opts)
    with torch.no_grad():
        infer = tk.triton_attention(q, k, v, **kw)
    train = tk.triton_attention(q.clone().requires_grad_(), k, v, **kw)
    assert torch.equal(infer, train.detach())
    args = (None, True, 2.77, True, True, 15.0, True)
    out, stats, aux = tk._forward(q, k, v, *args, for_backward=False)
    assert aux.numel() == 0
    with pytest.raises(RuntimeError, match="for_backward=True"):
        tk._backward(torch.zeros_like(out), q, k, v, out, None, stats, aux, *args[1:])


def test_deterministic_follows_torch_flag(monkeypatch):
    """torch.use_deterministic_algorithms(True) selects the deterministic backward (half
    precision; fp32 inputs always take the dq kernel)."""
    launched = []
    monkeypatch.setattr(tk, "_launch", lambda kernel, *a, **kw: launched.append(kernel.fn.__name__))
    q, k, v = _inputs(1, 2, 2, 9, 9, 16, torch.bfloat16)
    args = (None, True, 2.77, True, True, 15.0, True)
    out, stats, aux = tk._forward(q, k, v, *args)
    for flag, dq_kernel in ((False, False), (True, True)):
        launched.clear()
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda f=flag: f)
        tk._backward(torch.zeros_like(out), q, k, v, out, None, stats, aux, *args[1:], False)
        assert ("bwd_dq_kernel" in launched) == dq_kernel, launched
    q, k, v = (x.float() for x in (q, k, v))
    out, stats, aux = tk._forward(q, k, v, *args)
    launched.clear()
    tk._backward(torch.zeros_like(out), q, k, v, out, None, stats, aux, *args[1:], False)
    assert "bwd_dq_kernel" in launched


def _check_decode(name, p, q, k, v, mask=None, causal=True):
    """A decode step (no gradient) against the float64 reference: within 2x the reference's own
    error in the same dtype (the forward rule); returns the output."""
    variant, opts = _variant(name, p)
    kw = dict(is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], variant=variant, options=opts)
    gold = reference_attention(q.double(), k.double(), v.double(), attn_mask=mask, **kw)
    ref = reference_attention(q, k, v, attn_mask=mask, **kw)
    dev_mask = None if mask is None else mask.to(DEVICE)
    with torch.no_grad():
        fast = tk.triton_attention(
            q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), attn_mask=dev_mask, **kw
        ).cpu()
    assert fast.dtype == q.dtype and fast.shape == gold.shape and torch.isfinite(fast).all()
    ref_err, fast_err = _rms(ref.double() - gold), _rms(fast.double() - gold)
    assert fast_err <= max(2 * ref_err, FLOOR[q.dtype]), (fast_err, ref_err)
    return fast


@pytest.fixture
def decode_spy(monkeypatch):
    """Records the (nsplit, span) of every decode step the host splits (and so that it took the
    decode kernels)."""
    from lssar.ops.triton import decode

    seen = []

    def spy(*a, **kw):
        seen.append(decode.splits.__wrapped__(*a, **kw))
        return seen[-1]

    spy.__wrapped__ = decode.splits
    monkeypatch.setattr(decode, "splits", spy)
    return seen


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0), ("lssar", 1.0)])
@pytest.mark.parametrize("tq,tk,hq,hk", [(1, 300, 4, 2), (3, 40, 2, 2), (1, 1, 2, 1), (5, 3, 2, 2)])
def test_decode_step(decode_spy, name, p, tq, tk, hq, hk):
    """Split-K decode (GQA heads packed as rows; several cache slices at T_k = 300 on the
    interpreter's 8 'SMs'), causal with T_q > T_k too (rows that see no key: zeros)."""
    q, k, v = _inputs(2, hq, hk, tq, tk, 32, torch.bfloat16, seed=tq + tk)
    out = _check_decode(name, p, q, k, v)
    assert len(decode_spy) == 1
    if tk == 300:
        assert decode_spy[0][0] > 1  # several slices: their partial sums are added
    if tq > tk:
        assert (out[:, :, : tq - tk] == 0).all()


@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0)])
def test_decode_step_masks_and_half_precision(decode_spy, name, p):
    q, k, v = _inputs(2, 4, 2, 1, 150, 64, torch.bfloat16, seed=7)
    pad = torch.ones(2, 1, 1, 150, dtype=torch.bool)
    pad[1, ..., 120:] = False  # right padding of the second sequence
    _check_decode(name, p, q, k, v, mask=pad)
    q, k, v = _inputs(2, 2, 2, 3, 70, 32, torch.float16, seed=8)
    per_head = torch.rand(2, 2, 3, 70, generator=torch.Generator().manual_seed(2)) > 0.4
    per_head[0, 1, 2] = False  # a fully masked row: zeros
    out = _check_decode(name, p, q, k, v, mask=per_head, causal=False)
    assert (out[0, 1, 2] == 0).all()
    assert len(decode_spy) == 2


def test_decode_path_only_without_gradient(decode_spy):
    """With a gradient to record, more than 16 queries, or fp32 inputs a step runs the prefill
    kernels."""
    variant, opts = _variant("lssar", 15.0)
    q, k, v = _inputs(1, 2, 2, 2, 20, 16, torch.bfloat16)
    qg = q.clone().requires_grad_()
    tk.triton_attention(qg, k, v, is_causal=True, variant=variant, options=opts).sum().backward()
    assert decode_spy == [] and qg.grad is not None
    with torch.no_grad():
        for tq, dtype in ((17, torch.bfloat16), (2, torch.float32)):
            q, k, v = _inputs(1, 2, 2, tq, 20, 16, dtype)
            tk.triton_attention(q, k, v, is_causal=True, variant=variant, options=opts)
    assert decode_spy == []
    with torch.no_grad():  # the same step in bf16 does take them
        q, k, v = _inputs(1, 2, 2, 2, 20, 16, torch.bfloat16)
        tk.triton_attention(q, k, v, is_causal=True, variant=variant, options=opts)
    assert len(decode_spy) == 1


def test_value_head_dim_differs():
    q, k, _ = _inputs(1, 2, 2, 10, 10, 32, torch.float32, seed=6)
    v = _inputs(1, 2, 2, 10, 10, 48, torch.float32, seed=7)[2]
    _check("lssar", 15.0, q, k, v, causal=True)


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
    tensor-core instructions are checked in tests/test_triton_compile.py.)"""
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


# --------------------------------------------------------------------------- real GPU only

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0), ("lssar", 3.0)])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_long_bf16(name, p, d):
    q, k, v = _inputs(1, 4, 2, 4096, 4096, d, torch.bfloat16, seed=d)
    _check(name, p, q, k, v, causal=True, gqa=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,p", [("lssa", None), ("lssar", 15.0)])
def test_gpu_odd_shapes(name, p):
    q, k, v = _inputs(2, 4, 4, 1000, 1111, 100, torch.bfloat16, seed=1)
    _check(name, p, q, k, v, causal=True)
    q, k, v = _inputs(2, 4, 4, 777, 777, 64, torch.float16, seed=2)
    mask = torch.rand(2, 1, 777, 777, generator=torch.Generator().manual_seed(0)) > 0.2
    _check(name, p, q, k, v, mask=mask, causal=True)
