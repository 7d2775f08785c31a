"""Which blocks a kernel reads under packed documents, windows and sinks: only the keys its rows
may see (chunked, the fused CPU kernel, sdpa, the Triton programs and their key rows); the Triton
op with spans registered (schema, fake, autograd) and chosen by auto on CUDA."""

from __future__ import annotations

import types

import pytest
import torch

import lssar
from lssar.ops import chunked, registry, sdpa
from lssar.ops.spans import key_spans
from lssar.ops.variants import VARIANTS
from tests.ops.spans_inputs import DEVICE, DOCS, _cu, _inputs, _run, needs_triton


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
    from lssar.ops.cpu.build import kernel

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


def _interpreted_host():
    """The triton host module when its kernels run interpreted (16 x 16 tiles), else skip."""
    pytest.importorskip("triton")
    from lssar.ops.triton import host

    if not host._interpreting():
        pytest.skip("block sizes are known only in the interpreter (fixed 16 x 16 tiles)")
    return host


@needs_triton
@pytest.mark.parametrize(
    "kw,poison,bad,rows,keys",
    [
        # window + sinks: rows 64..79 read key blocks [0, 16) and [48, 80), not [16, 48); keys
        # 64..79 are seen by rows 64..79 only
        (dict(is_causal=True, window=(6, 0), sink_tokens=2), "qkv", slice(16, 48), 64, 64),
        # two documents of 40: rows 48..79 read key blocks [32, 80), not [0, 32) ...
        pytest.param(
            dict(cu_seqlens=_cu([40, 40])), "kv", slice(0, 32), 48, None, marks=pytest.mark.slow
        ),
        # ... and keys 48..79 are read by row blocks [32, 80), not [0, 32)
        pytest.param(
            dict(cu_seqlens=_cu([40, 40])), "q", slice(0, 32), 32, 48, marks=pytest.mark.slow
        ),
    ],
)
def test_triton_programs_read_only_the_blocks_their_spans_reach(kw, poison, bad, rows, keys):
    """Poison (NaN) queries, keys or values in blocks that some programs' spans do not reach: a
    program that visited them would multiply a NaN by a zero weight. The outputs and dq of the
    rows from ``rows`` on, and dk and dv of the keys from ``keys`` on, equal the clean run's
    (the rows of a block that reads a poisoned block legitimately turn NaN: they are before)."""
    _interpreted_host()
    q, k, v = (t.detach() for t in _inputs(80, 80, b=1, h=1))
    grad = torch.randn(q.shape)
    dirty = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    for name in poison:
        dirty[name][:, :, bad] = float("nan")
    leaves = [[t.requires_grad_() for t in xs] for xs in ((q, k, v), dirty.values())]
    clean, poisoned = (_run(*xs, grad, impl="triton", variant="lssar", **kw) for xs in leaves)
    assert torch.isnan(poisoned[0]).any()  # the poison is there, for the rows that see it
    for a, b in zip(clean[:2], poisoned[:2]):  # out, dq
        torch.testing.assert_close(b[:, :, rows:], a[:, :, rows:])
    if keys is not None:
        for a, b in zip(clean[2:], poisoned[2:]):  # dk, dv
            torch.testing.assert_close(b[:, :, keys:], a[:, :, keys:])


SPAN_CASES = [
    dict(t_q=63, t_k=63, is_causal=True, cu_seqlens=_cu(DOCS)),
    dict(t_q=63, t_k=63, is_causal=False, cu_seqlens=_cu(DOCS), window=(3, 2)),
    dict(t_q=70, t_k=70, is_causal=True, window=(6, 0), sink_tokens=2),
    dict(t_q=70, t_k=70, is_causal=False, window=(3, 4), sink_tokens=1),
    dict(t_q=70, t_k=70, is_causal=False, window=(None, 2)),
    dict(t_q=6, t_k=33, is_causal=True, cu_seqlens=_cu([2, 1, 3]), cu_seqlens_k=_cu([9, 4, 20])),
    # more queries than keys in a document, a window and sinks
    dict(
        t_q=40,
        t_k=80,
        is_causal=True,
        cu_seqlens=_cu([20, 3, 17]),
        cu_seqlens_k=_cu([5, 30, 45]),
        window=(7, 0),
        sink_tokens=3,
    ),
    dict(t_q=30, t_k=12, is_causal=False, cu_seqlens=_cu([25, 5]), cu_seqlens_k=_cu([4, 8])),
]


@pytest.mark.parametrize("case", SPAN_CASES)
def test_triton_key_rows_are_the_rows_that_see_each_key(case):
    """The dk/dv kernel's per-key query rows (computed on the host, without assuming the bounds
    are monotone) are exactly the rows that see the key, by the dense mask: the bounds of
    documents, windows and sinks are non-decreasing, for T_q != T_k too."""
    pytest.importorskip("triton")
    from lssar.ops.triton.host import _key_rows

    kw = dict(case)
    t_q, t_k = kw.pop("t_q"), kw.pop("t_k")
    spans = key_spans(t_q, t_k, torch.device("cpu"), **kw)
    first, last = _key_rows(spans, t_q).long()
    dense = spans.dense()
    for j in range(t_k):
        rows = dense[:, j].nonzero().flatten()
        if rows.numel() == 0:
            assert first[j] >= last[j], j
        else:
            assert (first[j].item(), last[j].item()) == (rows.min().item(), rows.max().item() + 1)
            assert dense[first[j] : last[j], j].all(), j  # one contiguous range


def test_triton_key_rows_cover_non_monotone_bounds():
    """Bounds out of order (no rule makes them today): the ranges still hold every row that
    sees each key (a superset: more work, the same result)."""
    pytest.importorskip("triton")
    from lssar.ops.triton.host import _rows_seeing

    g = torch.Generator().manual_seed(0)
    lo = torch.randint(0, 30, (50,), generator=g)
    hi = lo + torch.randint(0, 10, (50,), generator=g)
    first, last = _rows_seeing(lo, hi, 40)
    j = torch.arange(40)
    sees = (lo[:, None] <= j) & (j < hi[:, None])  # (rows, keys)
    i = torch.arange(50)[:, None]
    assert (~sees | ((i >= first) & (i < last))).all()


@needs_triton
def test_triton_op_with_spans_registers_schema_fake_and_autograd():
    pytest.importorskip("triton")
    from lssar.ops.triton import host

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g).to(DEVICE) for _ in range(3))
    spans = key_spans(20, 20, q.device, True, window=(4, 0), sink_tokens=2)
    bounds = (spans.lo, spans.hi, spans.sink_lo, spans.sink_hi)
    torch.library.opcheck(
        host.triton_softplus_attention_op,
        (q, k, v, None, False, 2.77, True, True, 15.0, True),
        dict(zip(("lo", "hi", "sink_lo", "sink_hi"), bounds)),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


@pytest.mark.skipif("triton" not in registry.IMPLS, reason="needs the triton package")
def test_auto_runs_spans_on_cuda_with_triton():
    cuda = types.SimpleNamespace(
        is_cuda=True, shape=(1, 1, 256, 8), dtype=torch.float32, device=torch.device("cuda")
    )
    assert registry.resolve("lssar", "auto", cuda, cuda, 0.0, {}, spans=True).impl == "triton"
    assert registry.IMPLS["triton"].supports(VARIANTS["lssar"], VARIANTS["lssar"].options)
