"""Decoding with a KV cache: T_q = 1..8 new queries against a cache of T_k keys.

On every implementation the registry lists for a variant, a decode step equals the last T_q rows of
the full causal call over the T_k tokens (forward, and dq/dk/dv where the impl has a backward),
with and without a key-padding mask, within the accuracy rule of tests/accuracy.py (the full call
in float64 on the reference is the ground truth). The caches split the kernels' blocks: the Triton
interpreter's 16-key tiles (T_k = 40, 300) and the fused CPU kernel's 512-key LSSA tiles (T_k =
1100). The GPT's KVCache and ``generate()`` against recomputing the whole sequence are in
tests/model/test_kv_cache.py. Elsewhere: ``test_attention.test_kv_cache_alignment`` (reference /
auto, float64), ``test_model`` (incremental logits of every variant in float64), ``test_hf`` (HF
caches, padding, static caches), ``test_triton_kernels`` / ``test_flex`` (T_q != T_k on their
shapes)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import lssar
from lssar.ops import registry
from tests.accuracy import assert_within_rule, err, rounding_sensitivity

VARIANTS = [("lssa", {}), ("lssar", {"p": 15.0}), ("softmax", {})]


B, H, D = 2, 2, 32


pytestmark = pytest.mark.usefixtures("one_thread")


# impls without a backward on CPU: checked forward only
FORWARD_ONLY = {"flex"}


# the Triton interpreter and CPU FlexAttention (a compile per shape, ~30 s here) are slow: their
# default cases are a few below, the whole grid runs under -m slow
SLOW_IMPLS = {"triton", "flex"}


def _steps(caches):
    return [(tq, tk) for tk in caches for tq in (1, 3, 8) if tq <= tk]


def _grid(steps, impls=None, exclude=SLOW_IMPLS):
    return [
        pytest.param(impl, name, opts, tq, tk, pad, id=f"{impl}-{name}-tq{tq}-tk{tk}-{pad}")
        for name, opts in VARIANTS
        for impl in registry.supporting(name, opts)
        if (impls is None or impl in impls) and impl not in exclude
        for tq, tk in steps
        for pad in ("none", "padding")
    ]


def _mask(tk: int, pad: str) -> torch.Tensor | None:
    """Key padding ``(B, 1, 1, T_k)``: the second sequence is left-padded by a quarter of the
    cache (its only key at T_k = 1: rows with no visible key, zeros)."""
    if pad == "none":
        return None
    m = torch.ones(B, 1, 1, tk, dtype=torch.bool)
    m[1, ..., : max(1, tk // 4)] = False
    return m


@functools.cache
def _inputs(tk: int):
    g = torch.Generator().manual_seed(tk)
    return tuple(torch.randn(B, H, tk, D, generator=g, dtype=torch.float64) for _ in range(3))


@functools.cache
def _golden(name: str, opts: tuple, tq: int, tk: int, pad: str):
    """The full causal call over all T_k tokens in float64 on the reference: its last T_q rows,
    and dq (last rows), dk, dv for an output gradient on those rows only."""
    q, k, v = (t.clone().requires_grad_() for t in _inputs(tk))
    out = lssar.attention(
        q, k, v, _mask(tk, pad), is_causal=True, variant=name, impl="reference", **dict(opts)
    )
    grad = torch.zeros_like(out)
    grad[..., -tq:, :] = _grad(tq)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return [out[..., -tq:, :].detach(), dq[..., -tq:, :], dk, dv]


@functools.cache
def _grad(tq: int) -> torch.Tensor:
    return torch.randn(B, H, tq, D, generator=torch.Generator().manual_seed(100 + tq)).double()


def _decode(impl, name, opts, tq, tk, pad, dtype, backward):
    q, k, v = _inputs(tk)
    # detached first: .to() of the same dtype is the cached tensor itself
    q, k, v = (t.detach().to(dtype).requires_grad_(backward) for t in (q[..., -tq:, :], k, v))
    kw = dict(is_causal=True, variant=name, impl=impl, **opts)
    with torch.set_grad_enabled(backward):
        out = lssar.attention(q, k, v, _mask(tk, pad), **kw)
    if not backward:
        return [out]
    return [out, *torch.autograd.grad(out, (q, k, v), _grad(tq).to(dtype))]


def _check_step(impl, name, opts, tq, tk, pad, backward=None):
    backward = impl not in FORWARD_ONLY if backward is None else backward
    golden = _golden(name, tuple(sorted(opts.items())), tq, tk, pad)[: 4 if backward else 1]

    def ref64(q, k, v):
        kw = dict(is_causal=True, variant=name, impl="reference", **opts)
        out = lssar.attention(q, k, v, _mask(tk, pad), **kw)
        return [out, *torch.autograd.grad(out, (q, k, v), _grad(tq))][: len(golden)]

    q, k, v = _inputs(tk)
    inputs64 = [t.clone().requires_grad_() for t in (q[..., -tq:, :], k, v)]
    sens = rounding_sensitivity(ref64, inputs64, golden, torch.float32)
    ref = _decode("reference", name, opts, tq, tk, pad, torch.float32, backward)
    fast = _decode(impl, name, opts, tq, tk, pad, torch.float32, backward)
    assert_within_rule(fast, ref, golden, sens)
    if pad == "padding" and tk == 1:  # the padded sequence's rows see no key: exactly zero
        assert torch.equal(fast[0][1], torch.zeros_like(fast[0][1]))
    # in float64 (where triton and flex run chunked) the step is the full call's rows to rounding
    fast64 = _decode(impl, name, opts, tq, tk, pad, torch.float64, backward)
    for f, g in zip(fast64, golden):
        assert err(f, g) < 1e-10 * (g.abs().max().item() + 1.0)


@pytest.mark.parametrize("impl,name,opts,tq,tk,pad", _grid(_steps([1, 7, 300])))
def test_decode_step_equals_last_rows_of_full_call(impl, name, opts, tq, tk, pad):
    _check_step(impl, name, opts, tq, tk, pad)


def test_decode_step_across_key_tiles():
    """The fused CPU kernel's LSSA forward tiles 512 keys (1100 = 512 + 512 + 76 keys)."""
    _check_step("cpu", "lssa", {}, 8, 1100, "padding")


FAST_TRITON = [
    pytest.param("triton", "lssar", {"p": 15.0}, 3, 40, "padding", id="triton-lssar-tq3-tk40"),
    pytest.param("triton", "lssa", {}, 1, 7, "none", id="triton-lssa-tq1-tk7"),
]


@pytest.mark.parametrize("impl,name,opts,tq,tk,pad", FAST_TRITON)
def test_triton_decode_step(impl, name, opts, tq, tk, pad):
    if "triton" not in registry.IMPLS:
        pytest.skip("triton is not installed")
    _check_step(impl, name, opts, tq, tk, pad)


@pytest.mark.slow
@pytest.mark.parametrize(
    "impl,name,opts,tq,tk,pad", _grid(_steps([1, 7, 300, 1100]), exclude=set())
)
def test_decode_step_every_impl_and_cache(impl, name, opts, tq, tk, pad):
    _check_step(impl, name, opts, tq, tk, pad)


def test_auto_decode_picks_an_implementation_that_runs_the_variant():
    """auto at a decode shape: SDPA for softmax; for lssar in float32 / bf16 without a gradient
    the fused kernel's decode entry at every cache length (float64: chunked's eager decode);
    with a gradient to record the fused kernel once T_q x T_k reaches
    registry.AUTO_CHUNK_MIN_SCORES, the materialised reference (O(T_k) per row) below."""
    q = torch.empty(1, 1, 1, 8)
    short, long = torch.empty(1, 1, 1024, 8), torch.empty(1, 1, registry.AUTO_CHUNK_MIN_SCORES, 8)
    assert registry.resolve("softmax", "auto", q, long, 0.0, {}).impl == "sdpa"
    with torch.no_grad():
        assert registry.resolve("lssar", "auto", q, short, 0.0, {}).impl == "cpu"
        half = q.bfloat16(), short.bfloat16()  # converted chunk by chunk in the kernel
        assert registry.resolve("lssar", "auto", *half, 0.0, {}).impl == "cpu"
        wide = q.double(), short.double()  # the eager decode of chunked
        assert registry.resolve("lssar", "auto", *wide, 0.0, {}).impl == "chunked"
    assert registry.resolve("lssar", "auto", q.requires_grad_(), short, 0.0, {}).impl == "reference"
    assert registry.resolve("lssar", "auto", q, long, 0.0, {}).impl == "cpu"


# ------------------------------------------------- the fused kernel's decode entry (impl="cpu")


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts the calls of the fused kernel's decode entry (skips where it cannot be built)."""
    from lssar.ops.cpu.build import kernel

    mod = kernel()
    if mod is None:
        pytest.skip("the fused CPU kernel cannot be built here")
    calls, real = [], mod.decode
    monkeypatch.setattr(mod, "decode", lambda *a: calls.append(a[1].shape) or real(*a))
    return calls


@pytest.fixture
def eager_calls(monkeypatch):
    """Counts the calls of the eager decode (``chunked``'s step; ``cpu``'s fallback)."""
    from lssar.ops import decode as chunked

    calls, real = [], chunked._eager_decode
    monkeypatch.setattr(chunked, "_eager_decode", lambda *a: calls.append(a[1].shape) or real(*a))
    return calls


@pytest.mark.parametrize(
    "name,opts,tq,tk,pad",
    [
        pytest.param(name, opts, tq, tk, pad, id=f"{name}-tq{tq}-tk{tk}-{pad}")
        for name, opts in VARIANTS[:2]
        # 2100 keys: three of the entry's 1024-key chunks
        for tq, tk in _steps([1, 7, 300, 2100])
        for pad in ("none", "padding")
    ],
)
def test_decode_without_a_gradient_equals_last_rows_of_full_call(
    decode_calls, eager_calls, name, opts, tq, tk, pad
):
    """Without a gradient to record a step takes a decode path: ``cpu`` in float32 the kernel's
    decode entry (keys normalised as they are read, key chunks' statistics added), ``chunked``
    (and ``cpu``'s float64, which runs chunked) the eager decode: the full call's rows within
    the rule (float64: to rounding)."""
    _check_step("cpu", name, opts, tq, tk, pad, backward=False)
    assert len(decode_calls) == 1 and len(eager_calls) == 1  # float32 entry, float64 eager
    _check_step("chunked", name, opts, tq, tk, pad, backward=False)
    assert len(decode_calls) == 1 and len(eager_calls) == 3


def _cache(x: torch.Tensor, room: int) -> torch.Tensor:
    """``x`` as a KV cache holds it: a view of a longer buffer whose unused tail is NaN."""
    buf = torch.full((*x.shape[:2], x.shape[2] + room, x.shape[3]), float("nan"), dtype=x.dtype)
    buf[:, :, : x.shape[2]] = x
    return buf[:, :, : x.shape[2]]


@pytest.mark.parametrize("impl", ["cpu", "chunked"])
@pytest.mark.parametrize("name,opts", [*VARIANTS[:2], ("lssar", {"p": 2.5}), ("softplus-l1", {})])
@pytest.mark.parametrize("tq", [1, 5])
def test_decode_gqa_in_place_and_nan_padding(decode_calls, eager_calls, impl, name, opts, tq):
    """GQA (4 query heads on 2 kv heads) without repeating the cache, keys and values read in
    place from views of longer buffers, and NaN in every masked key and value (left padding):
    never read into a result (``attention()`` does not zero them first for a decode path)."""
    g = torch.Generator().manual_seed(7)
    tk, pad = 1500, 600
    q = torch.randn(2, 4, tq, 16, generator=g)
    k, v = torch.randn(2, 2, tk, 16, generator=g), torch.randn(2, 2, tk, 16, generator=g)
    mask = torch.ones(2, 1, 1, tk, dtype=torch.bool)
    mask[1, ..., :pad] = False
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[1, :, :pad], dirty_v[1, :, :pad] = float("nan"), float("inf")
    kw = dict(is_causal=True, variant=name, enable_gqa=True, **opts)
    with torch.no_grad():
        out = lssar.attention(q, _cache(dirty_k, 9), _cache(dirty_v, 9), mask, impl=impl, **kw)
    # the cache itself: 2 kv heads, not repeated
    assert (decode_calls if impl == "cpu" else eager_calls) == [(2, 2, tk, 16)]
    want = lssar.attention(q.double(), k.double(), v.double(), mask, impl="reference", **kw)
    assert torch.isfinite(out).all()
    assert err(out, want) < 2e-5 * (want.abs().max().item() + 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,opts", VARIANTS[:2])
def test_cpu_decode_entry_reads_a_half_precision_cache(decode_calls, dtype, name, opts):
    """A bf16 / fp16 cache is converted chunk by chunk inside the kernel (no float32 copy of
    it): the step is as close to the float64 call on the same (rounded) inputs as the
    reference's own half-precision step."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 4, n, 32, generator=g).to(dtype) for n in (3, 1200, 1200))
    mask = torch.ones(2, 1, 1, 1200, dtype=torch.bool)
    mask[1, ..., :300] = False
    kw = dict(is_causal=True, variant=name, **opts)
    with torch.no_grad():
        fast = lssar.attention(q, _cache(k, 5), _cache(v, 5), mask, impl="cpu", **kw)
        ref = lssar.attention(q, k, v, mask, impl="reference", **kw)
    assert decode_calls == [(2, 4, 1200, 32)] and fast.dtype == dtype
    gold = lssar.attention(q.double(), k.double(), v.double(), mask, impl="reference", **kw)
    assert err(fast, gold) <= 1.5 * err(ref, gold) + 1e-6


@pytest.mark.parametrize(
    "kw",
    [
        {"window": (100, 0)},
        {"window": (100, 0), "sink_tokens": 4},
        {"cu_seqlens": torch.tensor([0, 700, 1300]), "is_causal": True},
    ],
    ids=["window", "window-sinks", "documents"],
)
def test_decode_with_windows_and_documents(decode_calls, eager_calls, kw):
    """A step's spans: the decode paths read only the keys the rows may see (a view of the
    cache for a window), N_i counted within them, as the reference."""
    g = torch.Generator().manual_seed(8)
    tk = 1300
    q = torch.randn(1, 2, 3, 16, generator=g)
    k, v = torch.randn(1, 2, tk, 16, generator=g), torch.randn(1, 2, tk, 16, generator=g)
    if "cu_seqlens" in kw:  # documents: the 3 new queries end the second one
        kw = {**kw, "cu_seqlens": torch.tensor([0, 0, 3]), "cu_seqlens_k": kw["cu_seqlens"]}
    for (name, opts), impl in itertools.product(VARIANTS[:2], ("cpu", "chunked")):
        calls = decode_calls if impl == "cpu" else eager_calls
        calls.clear()
        with torch.no_grad():
            out = lssar.attention(q, k, v, variant=name, impl=impl, **kw, **opts)
        assert len(calls) == 1 and calls[0][2] < tk
        want = lssar.attention(*(t.double() for t in (q, k, v)), variant=name, **kw, **opts)
        assert err(out, want) < 2e-5 * (want.abs().max().item() + 1.0)


def test_cpu_decode_entry_falls_back_where_every_weight_underflows(decode_calls, eager_calls):
    """softplus-l1 with a large scale and keys opposite the query: every visible softplus
    underflows float32, which the entry reports; the eager decode's relative weights answer
    (the NaN padding still never read)."""
    q = torch.ones(1, 1, 1, 8)
    k, v = -torch.ones(1, 1, 40, 8), torch.randn(1, 1, 40, 8)
    mask = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    mask[..., :10] = False
    dirty_v = v.clone()
    dirty_v[..., :10, :] = float("nan")
    kw = dict(variant="softplus-l1", scale=20.0)
    with torch.no_grad():
        out = lssar.attention(q, k, dirty_v, mask, impl="cpu", **kw)
    assert len(decode_calls) == 1 and len(eager_calls) == 1
    want = lssar.attention(q.double(), k.double(), v.double(), mask, impl="reference", **kw)
    torch.testing.assert_close(out, want.float())  # uniform over the 30 visible keys


def test_cpu_decode_without_the_kernel_hides_the_padding(monkeypatch, eager_calls):
    """Where the kernel cannot be built the entry falls back to the eager decode, which zeroes
    the masked values itself (attention() left them for the kernel to skip)."""
    from lssar.ops.cpu import build as cpu_kernel

    monkeypatch.setitem(cpu_kernel._loaded, "mod", None)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (1, 50, 50))
    mask = torch.ones(2, 1, 1, 50, dtype=torch.bool)
    mask[1, ..., :20] = False
    dk, dv = k.clone(), v.clone()
    dk[1, :, :20], dv[1, :, :20] = float("nan"), float("nan")
    with torch.no_grad():
        out = lssar.attention(q, dk, dv, mask, variant="lssar", p=15.0, impl="cpu")
    assert len(eager_calls) == 1
    want = lssar.attention(q.double(), k.double(), v.double(), mask, variant="lssar", p=15.0)
    assert err(out, want) < 1e-5


def test_key_norms_are_checked():
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    norms = torch.rand(1, 2, 5)
    with pytest.raises(ValueError, match="does not normalise its keys"):
        lssar.attention(q, k, k, variant="softmax", key_norms=norms)
    with pytest.raises(ValueError, match=r"must have shape \(1, 2, 5\)"):
        lssar.attention(q, k, k, variant="lssar", key_norms=norms[..., :4])
    with pytest.raises(ValueError, match="must be a float32 tensor"):
        lssar.attention(q, k, k, variant="lssar", key_norms=norms.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,opts", VARIANTS[:2])
def test_decode_entry_reads_given_key_norms(monkeypatch, dtype, name, opts):
    """With the cache's key_norms the decode entry normalises no key itself (it is handed the
    norms, GQA and a zero key included) and gives the step it computes without them."""
    from lssar.ops.cpu.build import kernel
    from lssar.ops.decode import key_inverse_norms

    mod = kernel()
    given, real = [], mod.decode
    monkeypatch.setattr(mod, "decode", lambda *a: given.append(a[3]) or real(*a))
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 3, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 1100, 32, generator=g).to(dtype) for _ in range(2))
    k[1, 0, 7] = 0.0
    kw = dict(is_causal=True, variant=name, enable_gqa=True, impl="cpu", **opts)
    with torch.no_grad():
        plain = lssar.attention(q, k, v, **kw)
        cached = lssar.attention(q, k, v, key_norms=key_inverse_norms(k), **kw)
    assert given[0] is None and given[1] is not None and given[1].shape == (2, 2, 1100)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert err(cached, plain) <= tol * plain.abs().max()
