"""Packed documents (``cu_seqlens``), sliding windows and sink tokens (issue #26), on every
implementation that takes them, against each document run alone and against the dense mask the
rule stands for, forward and gradients, within the accuracy rule of tests/accuracy.py."""

from __future__ import annotations

import pytest
import torch

import lssar
from lssar.ops import chunked, registry, sdpa
from lssar.ops.spans import key_spans, span_counts
from tests.accuracy import assert_within_rule, rounding_sensitivity

SOFTPLUS_IMPLS = ["reference", "chunked", "cpu"]
SOFTMAX_IMPLS = ["reference", "sdpa"]
CASES = [  # (variant, options, impls)
    ("lssar", {}, SOFTPLUS_IMPLS),
    ("lssa", {}, SOFTPLUS_IMPLS),
    ("softmax", {}, SOFTMAX_IMPLS),
    ("softmax-qknorm-logn", {}, SOFTMAX_IMPLS),
]
GRID = [(v, o, i) for v, o, impls in CASES for i in impls]
# documents of lengths that split 7-row blocks, with a 1-token and an empty document
DOCS = [5, 17, 1, 0, 40]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(t_q, t_k, dtype=torch.float32, b=2, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, t_k, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, t_k, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _run(q, k, v, grad, **kw):
    out = lssar.attention(q, k, v, **kw)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


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


@pytest.mark.parametrize("variant,opts,impl", GRID)
@pytest.mark.parametrize("causal", [True, False])
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


@pytest.mark.parametrize("variant,opts,impl", GRID)
@pytest.mark.parametrize("window,sinks,causal", WINDOWS)
def test_window_equals_its_dense_mask(variant, opts, impl, window, sinks, causal):
    t = 45
    q, k, v = _inputs(t, t, dtype=torch.float64)
    grad = torch.randn(q.shape, dtype=torch.float64)
    kw = dict(variant=variant, **opts)
    mask = _window_mask(t, *window, sinks, causal)
    want = _run(q, k, v, grad, impl="reference", attn_mask=mask, **kw)
    got = _run(
        q,
        k,
        v,
        grad,
        impl=impl,
        is_causal=causal,
        window=window,
        sink_tokens=sinks,
        impl_options=_small_blocks(impl),
        **kw,
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("impl", SOFTPLUS_IMPLS + ["sdpa"])
def test_window_with_key_padding_and_documents(impl):
    """A window inside packed documents, and a window with key padding: N_i counts what both
    allow (prefix sums for the padding)."""
    variant = "lssar" if impl != "sdpa" else "softmax-qknorm-logn"
    cu = _cu([11, 30])
    q, k, v = _inputs(41, 41, dtype=torch.float64)
    grad = torch.randn(q.shape, dtype=torch.float64)
    kw = dict(variant=variant, is_causal=True, impl_options=_small_blocks(impl))
    got = _run(q, k, v, grad, impl=impl, cu_seqlens=cu, window=(5, 0), **kw)
    doc = torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([11, 30]))
    dense = (doc[:, None] == doc[None, :]) & _window_mask(41, 5, 0, 0, True)
    want = _run(q, k, v, grad, impl="reference", attn_mask=dense, variant=variant)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    pad = torch.rand(2, 1, 1, 41, generator=torch.Generator().manual_seed(1)) > 0.3
    got = _run(q, k, v, grad, impl=impl, attn_mask=pad, window=(5, 0), **kw)
    want = _run(
        q, k, v, grad, impl="reference", attn_mask=pad & _window_mask(41, 5, 0, 0, True),
        variant=variant,
    )  # fmt: skip
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_counts_restart_at_each_document_and_count_the_window():
    spans = key_spans(8, 8, torch.device("cpu"), True, cu_seqlens=_cu([3, 5]))
    assert span_counts(spans, None).flatten().tolist() == [1, 2, 3, 1, 2, 3, 4, 5]
    spans = key_spans(8, 8, torch.device("cpu"), True, window=(2, 0), sink_tokens=1)
    assert span_counts(spans, None).flatten().tolist() == [1, 2, 3, 4, 4, 4, 4, 4]
    wide = key_spans(8, 8, torch.device("cpu"), True, window=(100, 100))
    assert span_counts(wide, None).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_padding_never_leaks_and_rows_without_keys_are_zero():
    """NaN / inf in padded keys (a window over key padding) never reach a row; queries of a
    document without keys give zeros, whatever they hold."""
    q, k, v = (t.detach() for t in _inputs(16, 16, dtype=torch.float64))
    pad = torch.ones(16, dtype=torch.bool)
    pad[3:7] = False
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3:7], v2[:, :, 3:7] = float("nan"), float("inf")
    cu_q, cu_k = _cu([2, 3]), _cu([0, 9])
    for impl in SOFTPLUS_IMPLS:
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


def test_a_block_reads_only_the_keys_its_rows_may_see(monkeypatch):
    """The chunked path over a window: every score slab is rows x (rows + window) at most."""
    widths = []
    weights = chunked._weights

    def spy(q, c, k, *a, **kw):
        widths.append(k.shape[2])
        return weights(q, c, k, *a, **kw)

    monkeypatch.setattr(chunked, "_weights", spy)
    q, k, v = (t.detach() for t in _inputs(400, 400))
    lssar.attention(
        q, k, v, is_causal=True, window=(31, 0), impl="chunked", impl_options={"block": 16}
    )
    assert widths and max(widths) <= 16 + 31


def test_the_fused_kernel_runs_the_blocks(monkeypatch):
    """impl='cpu' with spans goes through the fused kernel (not the eager fallback)."""
    calls = []
    fused = chunked._fused_call

    def spy(name, *a, **kw):
        got = fused(name, *a, **kw)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(chunked, "_fused_call", spy)
    q, k, v = _inputs(300, 300)
    lssar.attention(
        q, k, v, is_causal=True, cu_seqlens=_cu([100, 200]), impl="cpu"
    ).sum().backward()
    from lssar.ops.cpu_kernel import kernel

    if kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")  # eager fallback tested elsewhere
    assert calls and all(calls)


def test_sdpa_blocks_read_only_visible_keys(monkeypatch):
    seen = []
    block = sdpa._block

    def spy(q, k, *a, **kw):
        seen.append(k.shape[2])
        return block(q, k, *a, **kw)

    monkeypatch.setattr(sdpa, "_block", spy)
    monkeypatch.setattr(sdpa, "ALIBI_BLOCK_ELEMENTS", 2 * 200 * 10)  # 10 rows of 2 heads
    q, k, v = _inputs(200, 200)
    lssar.attention(q, k, v, is_causal=True, window=(19, 0), variant="softmax", impl="sdpa")
    assert seen and max(seen) <= 10 + 19


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
