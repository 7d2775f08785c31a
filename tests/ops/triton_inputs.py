"""Inputs, variants and the accuracy check shared by the tests of the Triton kernels (run by the
interpreter without a GPU: tests/conftest.py sets TRITON_INTERPRET=1 first)."""

import functools
import os

import torch

# triton.jit (also inside triton.language, e.g. tl.zeros) picks compiled or interpreted code when
# a function is decorated: without a GPU the variable must exist before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from lssar.ops.reference import reference_attention  # noqa: E402
from lssar.ops.variants import VARIANTS  # noqa: E402

pytest.importorskip("triton")

from lssar.ops.triton import host as tk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

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
           options=None, **fast_kw):  # fmt: skip
    """Fast vs reference error (both vs the float64 reference) for out and dq, dk, dv;
    ``options`` over the variant's (``{"scale_dim": 128}``)."""
    variant, opts = _variant(name, p)
    opts.update(options or {})
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
