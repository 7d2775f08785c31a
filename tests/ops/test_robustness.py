"""Legal-but-awkward inputs, held to the same contract by every implementation.

Each class below was once a crash or a silent wrong answer: broadcast masks at every
block size, key-axis broadcasting in N_i, half precision, masks that only broadcast *with* the
scores, NaN padding, degenerate sizes, extreme vector norms, underflowing rows, torch.func. The
grid of (implementation, variant) pairs comes from the registry, so a new backend is tested too.
"""

from __future__ import annotations

import math

import pytest
import torch

import lssar
from lssar.ops import chunked, registry
from tests.accuracy import assert_within_rule, err, rounding_sensitivity

REPRESENTATIVES = [  # one variant per code path, with the options that matter
    ("lssar", {}),
    ("lssar", {"p": 3.0}),
    ("lssa", {}),
    ("softplus-l1", {}),
    ("softmax", {}),
    ("ssmax", {"s": 1.3}),
    ("softmax-qknorm-logn", {}),
    ("sigmoid-l1", {}),
    ("relu", {}),
]
CPU_GRAD_FREE = {"flex"}  # FlexAttention on CPU runs forward only


def _cases(exclude=("flex",)):
    return [
        pytest.param(impl, name, opts, id=f"{impl}-{name}-{opts}")
        for impl in registry.IMPLS
        if impl not in exclude
        for name, opts in REPRESENTATIVES
        if impl in registry.supporting(name, opts)
    ]


CASES = _cases()
COSINE = {n for n, _ in REPRESENTATIVES if registry.get_variant(n).qk_norm}


def _qkv(b, hq, hk, tq, tk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, d))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _attn(q, k, v, impl, name, opts, grad=True, **kw):
    """Output and (unless the impl is forward-only) the input gradients of a fixed projection."""
    q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    out = lssar.attention(q, k, v, variant=name, impl=impl, **opts, **kw)
    if not grad:
        return [out.detach()]
    proj = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
    proj = proj.reshape(out.shape)
    return [out.detach(), *torch.autograd.grad((out * proj).sum(), (q, k, v))]


def _close(a, b, tol=2e-5):
    for i, (x, y) in enumerate(zip(a, b)):
        scale = y.abs().max().item() + 1.0
        assert torch.isfinite(x).all(), i
        assert err(x, y) <= tol * scale, (i, err(x, y))


@pytest.fixture
def small_blocks(monkeypatch):
    """chunked in 16-row query blocks, so short sequences span several blocks."""
    monkeypatch.setattr(chunked, "DEFAULT_BLOCK_ELEMS", 1)
    monkeypatch.setattr(chunked, "FUSED_BLOCK_ELEMS", 1)
    monkeypatch.setattr(chunked, "LSSA_ROWS", 16)
    monkeypatch.setattr(chunked, "LSSAR_ROWS", 16)
    monkeypatch.setattr(chunked, "LSSA_KEY_TILE", 16)  # lssa in 16-key tiles (40 = 16 + 16 + 8)


# 1, 2: every broadcastable mask, counted on its broadcast shape, at every block size
MASKS = {
    "key-padding [B,1,1,Tk]": lambda b, h, t: (
        torch.arange(t).expand(b, 1, 1, t) < torch.tensor([t, t - 5]).reshape(b, 1, 1, 1)
    ),
    "0-d True": lambda b, h, t: torch.tensor(True),
    "[B,1,Tq,1]": lambda b, h, t: (torch.arange(t) % 7 != 3).reshape(1, 1, t, 1).expand(b, 1, t, 1),
    "[Tq,1]": lambda b, h, t: (torch.arange(t) % 5 != 0).reshape(t, 1),
    "1-d [Tk]": lambda b, h, t: torch.arange(t) % 4 != 1,
    "per-head [1,H,Tq,Tk]": lambda b, h, t: (
        torch.rand(1, h, t, t, generator=torch.Generator().manual_seed(1)) > 0.2
    ),
}


@pytest.mark.parametrize("impl,name,opts", CASES)
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("causal", [False, True])
def test_broadcast_masks_equal_their_expansion(impl, name, opts, mask_name, causal, small_blocks):
    b, h, t, d = 2, 2, 40, 16
    q, k, v = _qkv(b, h, h, t, t, d)
    mask = MASKS[mask_name](b, h, t)
    full = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(b, h, t, t)
    got = _attn(q, k, v, impl, name, opts, attn_mask=mask, is_causal=causal)
    ref = _attn(
        q.double(),
        k.double(),
        v.double(),
        "reference",
        name,
        opts,
        attn_mask=full.contiguous(),
        is_causal=causal,
    )
    _close(got, ref)


@pytest.mark.parametrize("impl,name,opts", CASES)
def test_key_padding_many_blocks_long(impl, name, opts, small_blocks):
    """The HF wrapper's padded batch: [B, 1, 1, T_k] with causal, queries over many blocks."""
    b, h, t, d = 2, 3, 70, 8
    q, k, v = _qkv(b, h, h, t, t, d, seed=2)
    lengths = torch.tensor([t, 23])
    mask = (torch.arange(t) < lengths.reshape(b, 1, 1, 1)).reshape(b, 1, 1, t)
    got = _attn(q, k, v, impl, name, opts, attn_mask=mask, is_causal=True)
    ref = _attn(
        q.double(),
        k.double(),
        v.double(),
        "reference",
        name,
        opts,
        attn_mask=mask.expand(b, h, t, t).contiguous(),
        is_causal=True,
    )
    _close(got, ref)


# 3: half precision on the default path (normalisation and row scales in float32)
@pytest.mark.parametrize("impl,name,opts", [c for c in CASES if c.values[0] != "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_the_rule(impl, name, opts, dtype):
    q, k, v = _qkv(1, 2, 2, 200, 200, 32, dtype=dtype, seed=3)
    kw = dict(is_causal=True)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    golden = _attn(q64, k64, v64, "reference", name, opts, **kw)

    def run64(q, k, v):
        return _attn(q, k, v, "reference", name, opts, **kw)

    sens = rounding_sensitivity(run64, (q64, k64, v64), golden, dtype)
    # the reference in half precision: upcasts the inputs itself, rounds the output once
    ref = _attn(q, k, v, "reference", name, opts, **kw)
    fast = _attn(q, k, v, impl, name, opts, **kw)
    assert_within_rule(fast, ref, golden, sens, atol_rel=2 * torch.finfo(dtype).eps)


# 3b: autocast makes the op its half-precision self (SDPA's rule: inputs cast to the autocast
# dtype, then the op with autocast off), so every implementation keeps its float32 statistics
# and GEMMs; autocast left on inside rounded the reference's and chunked's score and value
# GEMMs to bf16 (LSSAR p=15 output errors 20-28x the same bf16 inputs without autocast)
AUTOCAST_CASES = [c for c in CASES if c.values[0] != "triton"] + [
    pytest.param(impl, name, opts, id=f"{impl}-{name}-{opts}")
    for impl in CPU_GRAD_FREE & set(registry.IMPLS)
    for name, opts in REPRESENTATIVES
    if impl in registry.supporting(name, opts)
]


def _autocast_within_the_rule(impl, name, opts, device):
    dtype = torch.bfloat16
    grad = impl not in CPU_GRAD_FREE or device != "cpu"
    q, k, v = _qkv(1, 2, 2, 130, 130, 32, seed=3)  # float32, as autocast's callers pass them
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    q64, k64, v64 = (t.double() for t in (qh, kh, vh))
    kw = dict(is_causal=True, grad=grad)
    golden = _attn(q64, k64, v64, "reference", name, opts, **kw)

    def run64(q, k, v):
        return _attn(q, k, v, "reference", name, opts, **kw)

    sens = rounding_sensitivity(run64, (q64, k64, v64), golden, dtype)
    ref = _attn(qh, kh, vh, "reference", name, opts, **kw)  # the same inputs, no autocast
    with torch.autocast(device, dtype=dtype):  # backward too: the harder case
        fast = _attn(q.to(device), k.to(device), v.to(device), impl, name, opts, **kw)
    fast = [t.cpu() for t in fast]  # the float64 baseline stays on the CPU
    assert fast[0].dtype == dtype  # a lower-precision op, like SDPA under autocast
    assert_within_rule(fast, ref, golden, sens, atol_rel=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("impl,name,opts", AUTOCAST_CASES)
def test_cpu_autocast_is_the_bf16_op_within_the_rule(impl, name, opts):
    _autocast_within_the_rule(impl, name, opts, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["reference", "chunked", "sdpa"])
def test_cuda_autocast_is_the_bf16_op_within_the_rule(impl):
    name = "softmax" if impl == "sdpa" else "lssar"
    _autocast_within_the_rule(impl, name, {}, "cuda")


@pytest.mark.parametrize(
    "impl,name,opts", [c for c in CASES if c.values[0] != "triton" and c.values[1] in COSINE]
)
def test_fp16_large_inputs_do_not_overflow_the_norm(impl, name, opts):
    """Only the cosine variants promise scale invariance."""
    q, k, val = _qkv(1, 2, 2, 150, 150, 32, dtype=torch.float16, seed=4)
    big = _attn(q * 2000, k * 2000, val, impl, name, opts, grad=False, is_causal=True)[0]
    small = _attn(q, k, val, impl, name, opts, grad=False, is_causal=True)[0]
    assert torch.isfinite(big).all()
    assert err(big, small) <= 4 * torch.finfo(torch.float16).eps * (small.abs().max().item() + 1)


# 4: a mask that only broadcasts *with* [B, H, T_q, T_k] is an error, not a wider output
@pytest.mark.parametrize(
    "mask_shape,tq",
    [((40, 40), 1), ((3, 1, 1, 40), 40), ((2, 5, 40, 40), 40), ((1, 1, 1, 1, 40), 40)],
)
@pytest.mark.parametrize("impl", ["auto", *registry.IMPLS])
def test_mask_must_broadcast_to_the_scores(mask_shape, tq, impl):
    q, k, v = _qkv(2, 2, 2, tq, 40, 16)
    mask = torch.ones(mask_shape, dtype=torch.bool)
    with pytest.raises(ValueError, match="attn_mask"):
        lssar.attention(q, k, v, attn_mask=mask, variant="lssar", impl=impl)


# 4b: the flags are bools on every implementation (a truthy 1 or "no" was causal on some,
# a TypeError deep inside others)
@pytest.mark.parametrize("flag", ["is_causal", "enable_gqa"])
@pytest.mark.parametrize("value", [1, 0, "no", None, torch.tensor(True)])
@pytest.mark.parametrize("impl", ["auto", *registry.IMPLS])
def test_flags_must_be_bools(flag, value, impl):
    q, k, v = _qkv(1, 2, 2, 6, 6, 8)
    name = "lssar" if impl in ("auto", *registry.supporting("lssar")) else "softmax"
    with pytest.raises(ValueError, match=f"^{flag} must be a bool"):
        lssar.attention(q, k, v, variant=name, impl=impl, **{flag: value})


# 5: masked keys, values and queries are never read
@pytest.mark.parametrize("impl,name,opts", CASES)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_poisoned_padding_never_leaks(impl, name, opts, poison, small_blocks):
    b, h, t, d = 2, 2, 40, 16
    q, k, v = _qkv(b, h, h, t, t, d, seed=5)
    keep = (torch.arange(t) < torch.tensor([t, 25]).reshape(b, 1)).reshape(b, 1, 1, t)
    rows = torch.ones(b, 1, t, 1, dtype=torch.bool)
    rows[1, :, 30:] = False  # padded queries too: their rows are fully masked
    mask = keep & rows
    clean = _attn(q, k, v, impl, name, opts, attn_mask=mask, is_causal=True)
    hidden_k = ~keep.reshape(b, 1, t, 1)
    qp = q.masked_fill(~rows, poison)
    kp, vp = k.masked_fill(hidden_k, poison), v.masked_fill(hidden_k, poison)
    dirty = _attn(qp, kp, vp, impl, name, opts, attn_mask=mask, is_causal=True)
    for c, x in zip(clean, dirty):
        assert torch.isfinite(x).all()
        assert torch.equal(c, x)
    assert (dirty[0][1, :, 30:] == 0).all()  # fully masked rows: zeros, whatever their query


# 6: degenerate sizes
@pytest.mark.parametrize("impl,name,opts", CASES)
def test_no_keys_gives_zeros(impl, name, opts):
    q, k, v = _qkv(1, 2, 2, 5, 0, 8)
    out, dq, dk, dv = _attn(q, k, v, impl, name, opts)
    assert out.shape == (1, 2, 5, 8) and (out == 0).all() and (dq == 0).all()
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("impl", ["auto", *registry.IMPLS])
def test_zero_head_dim_is_a_value_error(impl):
    q = torch.randn(1, 2, 4, 0)
    name = "lssar" if impl in ("auto", *registry.supporting("lssar")) else "softmax"
    with pytest.raises(ValueError, match="head dims"):
        lssar.attention(q, q, q, variant=name, impl=impl)


# 7: the cosine is scale-invariant at the extremes; a zero vector has cosine 0 and no gradient
@pytest.mark.parametrize(
    "impl,name,opts", [c for c in CASES if c.values[1] in ("lssar", "lssa", "softmax-qknorm-logn")]
)
@pytest.mark.parametrize("factor", [1e-30, 1e-14, 1e20, 1e30])
def test_cosine_scale_invariant(impl, name, opts, factor):
    q, k, v = _qkv(1, 2, 2, 30, 30, 16, seed=7)
    base = _attn(q, k, v, impl, name, opts, grad=False, is_causal=True)[0]
    scaled = _attn(q * factor, k * factor, v, impl, name, opts, grad=False, is_causal=True)[0]
    assert err(scaled, base) <= 1e-5 * (base.abs().max().item() + 1)


@pytest.mark.parametrize(
    "impl,name,opts", [c for c in CASES if c.values[1] in ("lssar", "lssa", "softmax-qknorm-logn")]
)
def test_zero_query_row_uniform_and_zero_gradient(impl, name, opts):
    q, k, v = _qkv(1, 1, 1, 30, 30, 16, seed=8)
    q[0, 0, 10] = 0.0
    out, dq, dk, dv = _attn(q, k, v, impl, name, opts)
    n = 30
    uniform = v[0, 0].double().mean(0)  # cosine 0 with every key: equal weights
    assert err(out[0, 0, 10], uniform) < 1e-5 * n
    assert (dq[0, 0, 10] == 0).all()
    assert torch.isfinite(dk).all() and dk.abs().max() < 1e3


# 8: ssmax's s is validated like p and bias
@pytest.mark.parametrize("s", [float("nan"), float("inf"), torch.tensor([1.0, float("nan")]), True])
def test_ssmax_s_must_be_finite(s):
    q, k, v = _qkv(1, 2, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="s must"):
        lssar.attention(q, k, v, variant="ssmax", s=s)


# 9: l1 rows whose every weight underflows fp32 are still proper averages
@pytest.mark.parametrize(
    "impl,name,opts",
    # the Triton kernels form softplus in registers: the relative row there is a kernel change
    # left for a GPU session (docs/api.md, awkward inputs), so they are not held to this case yet
    [c for c in CASES if c.values[1] in ("softplus-l1", "sigmoid-l1") and c.values[0] != "triton"],
)
def test_underflowing_rows_are_normalised(impl, name, opts):
    q, k, v = _qkv(1, 2, 2, 20, 20, 8, seed=9)
    q = q.abs() * 30
    k = -k.abs() * 30  # every score far below -104: softplus/sigmoid underflow in fp32
    got = _attn(q, k, v, impl, name, opts, is_causal=True, scale=1.0)
    ref = _attn(
        q.double(), k.double(), v.double(), "reference", name, opts, is_causal=True, scale=1.0
    )
    assert float(torch.finfo(torch.float32).tiny) > math.exp(-110)
    _close(got, ref, tol=1e-4)


# 10: torch.func on the default path; a clear error for what the fused kernels cannot do
def test_torch_func_grad_and_vmap_with_auto_at_long_length():
    q, k, v = _qkv(2, 2, 2, 130, 130, 16, seed=10)

    def f(q):
        return lssar.attention(q, k, v, is_causal=True, variant="lssar").square().sum()

    def f_ref(q):  # what auto runs under torch.func: the reference and its own autograd
        out = lssar.attention(q, k, v, is_causal=True, variant="lssar", impl="reference")
        return out.square().sum()

    qq = q.clone().requires_grad_()
    (expected,) = torch.autograd.grad(f_ref(qq), qq)
    assert err(torch.func.grad(f)(q), expected) < 1e-5
    per_sample = torch.func.vmap(torch.func.grad(f))(q.unsqueeze(0).expand(3, *q.shape))
    assert err(per_sample[2], expected) < 1e-5


def test_chunked_double_backward_names_the_limitation():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1, 1, 20, 20, 8))
    out = lssar.attention(q, k, v, is_causal=True, variant="lssar", impl="chunked")
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward.*impl='reference'"):
        g.sum().backward()
    with pytest.raises(ValueError, match="torch.func"):
        torch.func.grad(lambda q: lssar.attention(q, k, v, variant="lssar", impl="chunked").sum())(
            q.detach()
        )


def test_flex_forward_holds_the_padding_contract():
    """FlexAttention (CPU: forward only, compiled) on the NaN-padded key-padding batch."""
    assert "flex" in registry.IMPLS  # torch is pinned to a version with FlexAttention
    b, h, t, d = 2, 2, 32, 16
    q, k, v = _qkv(b, h, h, t, t, d, seed=11)
    keep = (torch.arange(t) < torch.tensor([t, 20]).reshape(b, 1)).reshape(b, 1, 1, t)
    kp = k.masked_fill(~keep.reshape(b, 1, t, 1), float("nan"))
    for name in ("lssar", "lssa"):
        got = _attn(q, kp, v, "flex", name, {}, grad=False, attn_mask=keep, is_causal=True)[0]
        ref = _attn(q, k, v, "reference", name, {}, grad=False, attn_mask=keep, is_causal=True)[0]
        assert torch.isfinite(got).all() and err(got, ref) < 1e-4


@pytest.mark.parametrize("impl", ["reference", "chunked", "cpu", "auto"])
def test_autocast_takes_mixed_float32_and_bf16_inputs_as_sdpa_does(impl):
    # an HF Llama under bf16 autocast rotates q, k in float32 (its cos/sin are float32) and
    # passes v in bf16: SDPA casts all three to autocast's dtype, so lssar must too
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = lssar.attention(q, k, v.bfloat16(), is_causal=True, impl=impl)
        same = lssar.attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True, impl=impl)
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed, same, rtol=0, atol=0)
    with pytest.raises(ValueError, match="share a dtype"):  # without autocast: still refused
        lssar.attention(q, k, v.bfloat16(), is_causal=True, impl=impl)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="share"):
        lssar.attention(q.double(), k, v, is_causal=True, impl=impl)  # float64 is never cast
