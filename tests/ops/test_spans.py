"""Packed documents (``cu_seqlens``), sliding windows and sink tokens, on every
implementation that takes them, against each document run alone and against the dense mask the
rule stands for, forward and gradients, within the accuracy rule of tests/accuracy.py.

``impl="triton"`` has no float64 kernels (float64 runs on chunked): it is compared in float32
within the accuracy rule (:func:`_assert_matches`). Without a GPU it runs in the Triton
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py; 16 x 16 tiles, so the lengths
here split its blocks): slow, so the default run keeps a few of its cases and ``-m slow`` the rest.
"""

from __future__ import annotations

import pytest
import torch

import lssar
from lssar.ops import registry
from lssar.ops.spans import key_spans, span_counts
from tests.accuracy import assert_within_rule, rounding_sensitivity
from tests.ops.spans_inputs import DEVICE, DOCS, _cu, _inputs, _run, needs_triton

SOFTPLUS_IMPLS = ["reference", "chunked", "cpu"]


SOFTMAX_IMPLS = ["reference", "sdpa"]


CASES = [  # (variant, options, impls)
    ("lssar", {}, SOFTPLUS_IMPLS),
    ("lssa", {}, SOFTPLUS_IMPLS),
    ("softmax", {}, SOFTMAX_IMPLS),
    ("softmax-qknorm-logn", {}, SOFTMAX_IMPLS),
]


GRID = [(v, o, i) for v, o, impls in CASES for i in impls]


def _triton(variant, *args, default=False):
    """A triton case of a grid: in the default run only when ``default`` (the interpreter is
    slow), else under ``-m slow``."""
    marks = [needs_triton] + ([] if default else [pytest.mark.slow])
    return pytest.param(variant, {}, "triton", *args, marks=marks)


def _assert_matches(impl, q, k, v, grad, fast_kw, ref_kw):
    """``impl`` with ``fast_kw`` against the reference with ``ref_kw`` (the same visibility
    written another way), outputs and gradients, on float64 inputs: exactly (to float64
    rounding), or for triton in float32 within the accuracy rule (float64 against a float64
    reference on the rounded inputs, tolerance from the float32 reference's own error)."""
    if impl != "triton":
        got = _run(q, k, v, grad, impl=impl, **fast_kw)
        want = _run(q, k, v, grad, impl="reference", **ref_kw)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        return
    x32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    x64 = [t.detach().double().requires_grad_() for t in x32]
    golden = _run(*x64, grad, impl="reference", **ref_kw)
    ref = _run(*x32, grad.float(), impl="reference", **ref_kw)
    fast = _run(*x32, grad.float(), impl="triton", **fast_kw)

    def run64(*xs):
        return _run(*xs, grad, impl="reference", **ref_kw)

    # 8 perturbations, not 2: p = 15 makes a few rows ill-conditioned, where 2 underestimate the
    # conditioning and the kernel's error on them (the same with a dense mask) would be judged
    # against the float32 reference's lucky draw
    sens = rounding_sensitivity(run64, x64, golden, torch.float32, tries=8)
    assert_within_rule(fast, ref, golden, sens)


def _small_blocks(impl):
    return {"block": 7} if impl in ("chunked", "cpu") else None


def _per_document(q, k, v, grad, cu_q, cu_k, **kw):
    """Each document alone through the reference, outputs and gradients laid back out packed."""
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for (a, b), (c, e) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        if b == a or e == c:
            continue
        parts = [t[:, :, a:b].detach().requires_grad_() for t in (q,)]
        parts += [t[:, :, c:e].detach().requires_grad_() for t in (k, v)]
        o, *g = _run(*parts, grad[:, :, a:b], impl="reference", **kw)
        out[:, :, a:b] = o
        grads[0][:, :, a:b] = g[0]
        grads[1][:, :, c:e] = g[1]
        grads[2][:, :, c:e] = g[2]
    return [out, *grads]


PACKED = [(v, o, i, c) for v, o, i in GRID for c in (True, False)] + [
    _triton("lssar", True, default=True),
    _triton("lssar", False),
    _triton("lssa", True),
    _triton("lssa", False),
]


@pytest.mark.parametrize("variant,opts,impl,causal", PACKED)
def test_packed_batch_equals_each_document_alone(variant, opts, impl, causal):
    cu = _cu(DOCS)
    t = int(cu[-1])
    q, k, v = _inputs(t, t)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    grad64 = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    kw = dict(variant=variant, is_causal=causal, **opts)
    golden = _per_document(q64, k64, v64, grad64, cu, cu, **kw)
    ref = _per_document(q, k, v, grad64.float(), cu, cu, **kw)
    fast = _run(
        q, k, v, grad64.float(), impl=impl, cu_seqlens=cu, impl_options=_small_blocks(impl), **kw
    )

    def run64(*xs):
        return _per_document(*xs, grad64, cu, cu, **kw)

    sens = rounding_sensitivity(run64, (q64, k64, v64), golden, torch.float32)
    assert_within_rule(fast, ref, golden, sens)


@pytest.mark.parametrize("impl", SOFTPLUS_IMPLS)
def test_packed_queries_against_a_packed_cache(impl):
    """T_q != T_k: each document's new queries (cu_seqlens) against its keys (cu_seqlens_k),
    bottom-right aligned within the document, as each document's own KV-cache call."""
    cu_q, cu_k = _cu([2, 1, 3]), _cu([9, 4, 20])
    q, k, v = _inputs(int(cu_q[-1]), int(cu_k[-1]), dtype=torch.float64)
    grad = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    kw = dict(variant="lssar", is_causal=True)
    want = _per_document(q, k, v, grad, cu_q, cu_k, **kw)
    got = _run(q, k, v, grad, impl=impl, cu_seqlens=cu_q, cu_seqlens_k=cu_k, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@needs_triton
@pytest.mark.parametrize(
    "cu_q,cu_k,window,sinks",
    [
        ([2, 1, 3], [9, 4, 20], None, 0),
        # documents whose queries split 16-row blocks, one with more queries than keys, a window
        # and sinks: per key, the rows that see it come from the host's ranges (dk/dv)
        ([20, 3, 17], [5, 30, 45], (7, 0), 3),
    ],
)
def test_triton_packed_queries_against_a_packed_cache(cu_q, cu_k, window, sinks):
    cu_q, cu_k = _cu(cu_q), _cu(cu_k)
    q, k, v = _inputs(int(cu_q[-1]), int(cu_k[-1]), dtype=torch.float64, b=1)
    grad = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    kw = dict(
        variant="lssar", is_causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k, window=window,
        sink_tokens=sinks,
    )  # fmt: skip
    _assert_matches("triton", q, k, v, grad, kw, kw)


def _window_mask(t, left, right, sinks, causal):
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    m = torch.ones(t, t, dtype=torch.bool)
    if causal:
        m &= j <= i
    if left is not None:
        m &= j >= i - left
    if right is not None:
        m &= j <= i + right
    if sinks:
        m |= (j < sinks) & ((j <= i) if causal else True)
    return m


WINDOWS = [((6, 0), 0, True), ((6, 0), 2, True), ((3, 4), 1, False), ((None, 2), 0, False)]


# the sinks' blocks and the window's with blocks between them to skip: rows 48.. of 16-row tiles
WINDOW_GRID = [(v, o, i, *w) for v, o, i in GRID for w in WINDOWS] + [
    _triton(variant, *w, default=(variant, w) == ("lssar", WINDOWS[1]))
    for variant in ("lssar", "lssa")
    for w in WINDOWS
]


@pytest.mark.parametrize("variant,opts,impl,window,sinks,causal", WINDOW_GRID)
def test_window_equals_its_dense_mask(variant, opts, impl, window, sinks, causal):
    t = 70
    q, k, v = _inputs(t, t, dtype=torch.float64)
    grad = torch.randn(q.shape, dtype=torch.float64)
    kw = dict(variant=variant, **opts)
    mask = _window_mask(t, *window, sinks, causal)
    fast = dict(
        is_causal=causal, window=window, sink_tokens=sinks, impl_options=_small_blocks(impl), **kw
    )
    _assert_matches(impl, q, k, v, grad, fast, dict(attn_mask=mask, **kw))


@needs_triton
@pytest.mark.parametrize("key_major,one_grad", [(False, False), (True, False), (True, True)])
def test_triton_gqa_with_window_and_sinks(force_dkdv, key_major, one_grad):
    """A key head's dk/dv sum over its query heads (the group loop of the dk/dv kernel), in the
    default formulation and in those for sm_90's wgmma (lssar.ops.triton.autotune)."""
    force_dkdv(key_major, one_grad)
    q, _, _ = _inputs(40, 40, dtype=torch.float64, b=1, h=4)
    _, k, v = _inputs(40, 40, dtype=torch.float64, b=1, h=2, seed=1)
    grad = torch.randn(q.shape, dtype=torch.float64)
    kw = dict(variant="lssar", enable_gqa=True)
    fast = dict(window=(3, 4), sink_tokens=1, **kw)
    _assert_matches(
        "triton", q, k, v, grad, fast, dict(attn_mask=_window_mask(40, 3, 4, 1, False), **kw)
    )


@pytest.mark.parametrize(
    "impl", SOFTPLUS_IMPLS + ["sdpa", pytest.param("triton", marks=needs_triton)]
)
def test_window_with_key_padding_and_documents(impl):
    """A window inside packed documents, and a window with key padding: N_i counts what both
    allow (prefix sums for the padding)."""
    variant = "lssar" if impl != "sdpa" else "softmax-qknorm-logn"
    cu = _cu([11, 30])
    q, k, v = _inputs(41, 41, dtype=torch.float64)
    grad = torch.randn(q.shape, dtype=torch.float64)
    kw = dict(variant=variant, is_causal=True, impl_options=_small_blocks(impl))
    doc = torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([11, 30]))
    dense = (doc[:, None] == doc[None, :]) & _window_mask(41, 5, 0, 0, True)
    fast = dict(cu_seqlens=cu, window=(5, 0), **kw)
    _assert_matches(impl, q, k, v, grad, fast, dict(attn_mask=dense, variant=variant))
    pad = torch.rand(2, 1, 1, 41, generator=torch.Generator().manual_seed(1)) > 0.3
    fast = dict(attn_mask=pad, window=(5, 0), **kw)
    ref = dict(attn_mask=pad & _window_mask(41, 5, 0, 0, True), variant=variant)
    _assert_matches(impl, q, k, v, grad, fast, ref)


def test_counts_restart_at_each_document_and_count_the_window():
    spans = key_spans(8, 8, torch.device("cpu"), True, cu_seqlens=_cu([3, 5]))
    assert span_counts(spans, None).flatten().tolist() == [1, 2, 3, 1, 2, 3, 4, 5]
    spans = key_spans(8, 8, torch.device("cpu"), True, window=(2, 0), sink_tokens=1)
    assert span_counts(spans, None).flatten().tolist() == [1, 2, 3, 4, 4, 4, 4, 4]
    wide = key_spans(8, 8, torch.device("cpu"), True, window=(100, 100))
    assert span_counts(wide, None).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("impl", SOFTPLUS_IMPLS + [pytest.param("triton", marks=needs_triton)])
def test_padding_never_leaks_and_rows_without_keys_are_zero(impl):
    """NaN / inf in padded keys (a window over key padding) never reach a row; queries of a
    document without keys give zeros, whatever they hold."""
    dtype = torch.float32 if impl == "triton" else torch.float64  # (triton: float64 is chunked)
    q, k, v = (t.detach().to(DEVICE if impl == "triton" else "cpu") for t in _inputs(16, 16, dtype))
    pad = torch.ones(16, dtype=torch.bool, device=q.device)
    pad[3:7] = False
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3:7], v2[:, :, 3:7] = float("nan"), float("inf")
    cu_q, cu_k = _cu([2, 3]), _cu([0, 9])
    kw = dict(is_causal=True, window=(4, 0), impl=impl)
    a = lssar.attention(q, k, v, attn_mask=pad, **kw)
    b = lssar.attention(q, k2, v2, attn_mask=pad, **kw)
    torch.testing.assert_close(a, b)
    q5 = q[:, :, :5].clone()
    q5[:, :, :2] = float("nan")
    out = lssar.attention(
        q5, k[:, :, :9], v[:, :, :9], is_causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k,
        impl=impl,
    )  # fmt: skip
    assert torch.isfinite(out).all() and (out[:, :, :2] == 0).all()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cu_seqlens=torch.tensor([0, 5.0, 10])), "int32/int64"),
        (dict(cu_seqlens=torch.tensor([[0, 10]])), "1-D"),
        (dict(cu_seqlens=torch.tensor([1, 10])), "start at 0"),
        (dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), "non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0, 4, 9])), "end at the sequence length 10"),
        (dict(cu_seqlens=torch.tensor([0])), "at least 2"),
        (dict(cu_seqlens_k=torch.tensor([0, 10])), "needs cu_seqlens"),
        (
            dict(cu_seqlens=torch.tensor([0, 10]), attn_mask=torch.ones(10, 10, dtype=torch.bool)),
            "ambiguous",
        ),
        (dict(window=(-1, 0)), "window sides must be >= 0"),
        (dict(window=5), "pair \\(left, right\\)"),
        (dict(window=(2.5, 0)), "pair"),
        (dict(sink_tokens=2), "pass window"),
        (dict(window=(None, 0), sink_tokens=2), "bounded left side"),
        (dict(window=(2, 0), sink_tokens=-1), "sink_tokens must be an int >= 0"),
    ],
)
def test_bad_spans_input(kw, match):
    q, k, v = (t.detach() for t in _inputs(10, 10))
    with pytest.raises(ValueError, match=match):
        lssar.attention(q, k, v, is_causal=True, **kw)


def test_cu_seqlens_with_a_cache_needs_the_keys_boundaries():
    q, _, _ = (t.detach() for t in _inputs(4, 4))
    _, k, v = (t.detach() for t in _inputs(10, 10))
    with pytest.raises(ValueError, match="pass cu_seqlens_k"):
        lssar.attention(q, k, v, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="same documents"):
        lssar.attention(
            q, k, v, cu_seqlens=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 5, 10])
        )


def test_an_impl_without_spans_names_the_ones_with_them(monkeypatch):
    import dataclasses

    entry = dataclasses.replace(registry.BACKENDS["chunked"], spans=False)
    monkeypatch.setitem(registry.BACKENDS, "chunked", entry)
    monkeypatch.setitem(registry.IMPLS, "chunked", entry)
    q, k, v = (t.detach() for t in _inputs(10, 10))
    with pytest.raises(ValueError, match="cannot take cu_seqlens.*reference"):
        lssar.attention(q, k, v, window=(2, 0), impl="chunked")


@pytest.mark.skipif("flex" not in registry.IMPLS, reason="no FlexAttention with AuxRequest")
@pytest.mark.parametrize("variant", [pytest.param("lssa", marks=pytest.mark.slow), "lssar"])
def test_flex_takes_spans_through_its_block_mask(variant):
    """impl='flex' (forward only on CPU): documents, a window with sinks, and both, against the
    float64 reference of the same spans."""
    cu = _cu([40, 1, 109])
    q, k, v = (t.detach() for t in _inputs(150, 150))
    for kw in (
        dict(cu_seqlens=cu),
        dict(window=(20, 0), sink_tokens=3),
        dict(cu_seqlens=cu, window=(10, 5)),
    ):
        with torch.no_grad():
            out = lssar.attention(q, k, v, is_causal=True, variant=variant, impl="flex", **kw)
        ref = lssar.attention(
            *(t.double() for t in (q, k, v)), is_causal=True, variant=variant, **kw
        )
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-5)
