"""The references vs the paper: gradcheck in float64, the paper's LSSAR formula, the centred
identity, the constant-scale and learned-scale variants, re-weighting on other normalisers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import lssar
from lssar.ops import registry
from lssar.ops.reference import attention_weights
from lssar.ops.variants import VARIANTS
from tests.ops.attention_inputs import _inputs, _padding_mask


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("masked", [False, True])
def test_reference_gradcheck(name, masked):
    shape = (1, 2, 2, 6, 6, 8)
    q, k, v = _inputs(shape, torch.float64, seed=3)
    mask = _padding_mask(shape, seed=3) if masked else None
    opts = {"s": torch.tensor([0.7, 1.4], dtype=torch.float64)} if name == "ssmax" else {}

    def fn(q, k, v):
        return lssar.attention(
            q, k, v, mask, is_causal=True, variant=name, impl="reference", **opts
        )

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("name", ["softplus-l1", "sigmoid-l1", "softmax"])
def test_reweighting_on_other_normalisers_gradcheck(name):
    q, k, v = _inputs((1, 1, 1, 7, 7, 8), torch.float64, seed=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: lssar.attention(
            q, k, v, is_causal=True, variant=name, impl="reference", p=15.0
        ),
        (q, k, v),
    )


def _paper_lssar(q, k, p):
    """docs/method.md sections 3-4 literally, one row at a time, for a causal single head."""
    t, d = q.shape
    rows = []
    for i in range(t):
        n = i + 1
        c = math.log(d) * math.log(n)
        s = c * F.normalize(q[i], dim=-1) @ F.normalize(k[:n], dim=-1).T
        a = F.softplus(s)
        big_a = a / a.sum()
        x = F.relu(n * big_a - (1.0 if n > 3 else 0.0))
        w = x**p / (x**p).sum() if x.max() > 0 else big_a
        rows.append(F.pad(w, (0, t - n)))
    return torch.stack(rows)


@pytest.mark.parametrize("p", [1.0, 3.0, 15.0])
def test_reference_is_the_paper_formula(p):
    q, k, _ = _inputs((1, 1, 1, 12, 12, 16), torch.float64, seed=5)
    w = attention_weights(q, k, is_causal=True, variant=VARIANTS["lssar"], options={"p": p})
    assert torch.allclose(w[0, 0], _paper_lssar(q[0, 0], k[0, 0], p), atol=1e-12)


def test_centred_identity_of_method_section_4():
    """P_ij is proportional to ReLU(softplus(s_ij) - mu_i)^p for N_i > 3, softplus^p below."""
    q, k, _ = _inputs((1, 1, 1, 9, 9, 16), torch.float64, seed=6)
    p = 15.0
    w = attention_weights(q, k, is_causal=True, variant=VARIANTS["lssar"], options={"p": p})[0, 0]
    d = q.shape[-1]
    for i in range(9):
        n = i + 1
        s = (
            math.log(d)
            * math.log(n)
            * F.normalize(q[0, 0, i], dim=-1)
            @ F.normalize(k[0, 0, :n], dim=-1).T
        )
        a = F.softplus(s)
        x = F.relu(a - a.mean()) if n > 3 else a
        assert torch.allclose(w[i, :n], x**p / (x**p).sum(), atol=1e-12)


@pytest.mark.parametrize(
    "name, phi, s_h",
    [
        ("softmax-qknorm-const", torch.exp, None),
        ("softmax-qknorm-learned", torch.exp, [0.6, 1.7]),
        ("lssa-const", F.softplus, None),
    ],
)
def test_constant_scale_variants_are_their_formula(name, phi, s_h):
    """c = s_h ln(d) ln(n) on every row (s_h = 1 without a learned scale), then phi and l1,
    row by row; at the row that sees exactly n keys it is LSSA's / softmax-qknorm-logn's scale."""
    q, k, _ = _inputs((1, 2, 2, 9, 9, 16), torch.float64, seed=7)
    n, d = 5, 16
    opts = {"n": n} | ({} if s_h is None else {"s": torch.tensor(s_h, dtype=torch.float64)})
    w = attention_weights(q, k, is_causal=True, variant=VARIANTS[name], options=opts)[0]
    for h in range(2):
        c = math.log(d) * math.log(n) * (1.0 if s_h is None else s_h[h])
        for i in range(9):
            cos = F.normalize(q[0, h, i], dim=-1) @ F.normalize(k[0, h, : i + 1], dim=-1).T
            a = phi(c * cos)
            assert torch.allclose(w[h, i, : i + 1], a / a.sum(), atol=1e-12)
            assert torch.all(w[h, i, i + 1 :] == 0)
    if s_h is None:
        log_n = "softmax-qknorm-logn" if phi is torch.exp else "lssa"
        ref = attention_weights(q, k, is_causal=True, variant=VARIANTS[log_n], options={})[0]
        assert torch.allclose(w[:, n - 1], ref[:, n - 1], atol=1e-12)  # row n - 1 sees n keys
        assert not torch.allclose(w[:, -1], ref[:, -1], atol=1e-3)


def test_learned_scale_gradcheck_through_s_and_sdpa_agrees():
    q, k, v = _inputs((1, 2, 2, 6, 6, 8), torch.float64, seed=8)
    s = torch.tensor([0.7, 1.4], dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, s, impl="reference"):
        return lssar.attention(
            q, k, v, is_causal=True, variant="softmax-qknorm-learned", impl=impl, n=6, s=s
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, s))
    assert torch.allclose(fn(q, k, v, s, "sdpa"), fn(q, k, v, s), atol=1e-12)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="n \\(the length whose scale"):
            lssar.attention(q, k, v, variant="softmax-qknorm-const", n=bad)
    with pytest.raises(ValueError, match="takes no `scale`"):
        lssar.attention(q, k, v, variant="lssa-const", scale=0.5)
    # the fused softplus kernels compute ln(N_i) or a 1/sqrt(d) scale, not a frozen one: they
    # refuse lssa-const rather than run another rule
    assert registry.supporting("lssa-const") == ["reference"]
    with pytest.raises(ValueError, match="does not run variant 'lssa-const'"):
        lssar.attention(q, k, v, variant="lssa-const", impl="chunked")


def test_reweighting_on_softmax_with_the_length_scale():
    """softmax-qknorm-logn p=15 (a decomposition arm): the LSSAR re-weighting of its rows."""
    q, k, v = _inputs((1, 1, 1, 7, 7, 8), torch.float64, seed=9)
    base = VARIANTS["softmax-qknorm-logn"]
    a = attention_weights(q, k, is_causal=True, variant=base, options={})[0, 0]
    w = attention_weights(q, k, is_causal=True, variant=base, options={"p": 15.0})[0, 0]
    for i in range(7):
        n = i + 1
        x = F.relu(n * a[i, :n] - (1.0 if n > 3 else 0.0))
        want = x**15 / (x**15).sum() if x.max() > 0 else a[i, :n]
        assert torch.allclose(w[i, :n], want, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda q, k, v: lssar.attention(
            q, k, v, is_causal=True, variant="softmax-qknorm-logn", p=15.0
        ),
        (q, k, v),
    )
