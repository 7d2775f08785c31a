"""The Triton decode path: a decode step (T_q <= 8 against a cache) matches the reference on every
head layout, with masks and in half precision, and runs only without a gradient."""

import os

import torch

# triton.jit (also inside triton.language, e.g. tl.zeros) picks compiled or interpreted code when
# a function is decorated: without a GPU the variable must exist before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from lssar.ops.reference import reference_attention  # noqa: E402

pytest.importorskip("triton")

from lssar.ops.triton import host as tk  # noqa: E402
from tests.ops.triton_inputs import DEVICE, FLOOR, _inputs, _rms, _variant  # noqa: E402

if DEVICE == "cpu" and not tk._interpreting():
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set (by an earlier test module?): "
        "set it in the environment or in tests/conftest.py, or run this file alone",
        allow_module_level=True,
    )


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
