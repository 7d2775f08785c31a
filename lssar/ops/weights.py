"""The softplus-l1 weight rule (LSSA, and LSSAR's re-weighting), one definition for every
eager path: the blocked forward and backward of :mod:`lssar.ops.chunked` and the eager decode of
:mod:`lssar.ops.decode`.

:func:`softplus_weights` is docs/method.md section 4 on one slab of score rows: the row scale
applied after the GEMM, the underflow shift for rows whose every softplus underflowed, the
mean-centring threshold and ``r^p`` (:func:`ipow`); :func:`row_scale` is the row scale ``c_i``.
The fused kernels (C++, Triton) compute the same rule in their own code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lssar.ops.common import centred_rows, centring_mean, log_phi, uniform_tolerance


def ipow(r: Tensor, p: float) -> Tensor:
    """``r**p`` by repeated squaring when ``p`` is a small integer (exact and faster than pow)."""
    if p == int(p) and 1 <= p <= 64:
        n, result, base = int(p), None, r
        while n:
            if n & 1:
                result = base if result is None else result * base
            n >>= 1
            if n:
                base = base * base
        return result
    return r.pow(p)


def softplus_weights(
    q: Tensor,
    c: Tensor,
    k: Tensor,
    m: Tensor | None,
    n: Tensor,
    p: float | None,
    want_pm1: bool = False,
):
    """Unnormalised block weights ``num (B, H, rows, T_k)`` and their row sums ``den``.

    ``s = (q @ k^T) c``: the row scale ``c_i`` after the GEMM, as the reference and the fused
    kernel apply it (scaling ``q`` first rounds once more, and p = 15 amplifies that rounding
    into gradient errors beyond the accuracy rule at T = 4-5). The final weights are
    ``num / den``; callers divide the (small) output or gradient instead of the slab. Also
    returns ``s`` and, for re-weighting, the statistics the backward needs.
    """
    s = (q @ k.transpose(-1, -2)) * c  # (B, H, rows, T_k)
    a = F.softplus(s)
    if m is not None:
        a = torch.where(m, a, 0.0)  # select, never multiply: masked inf/nan must not leak
    z = a.sum(-1, keepdim=True)
    shift = None
    if bool(((z == 0) & (n > 0)).any()):  # rare: every visible softplus underflowed (s < -104)
        # the same row relative to its largest weight, a_ij / phi(max_j s_ij): cannot underflow
        ls = log_phi(s, "softplus")
        if m is not None:
            ls = torch.where(m, ls, float("-inf"))
        shift = ls.amax(-1, keepdim=True)
        shift = torch.where((z == 0) & torch.isfinite(shift), shift, 0.0)
        a = torch.where(z == 0, torch.exp(ls - shift), a)
        z = a.sum(-1, keepdim=True)
    z = torch.where(z > 0, z, torch.ones_like(z))  # fully masked rows: a = 0, any z works
    if p is None:
        return s, a, z, (shift,)
    big = centred_rows(n)  # O_i = 1
    mu = centring_mean(z, n)
    x = F.relu(a - mu)  # masked entries: 0 - mu <= 0
    x_max = x.amax(-1, keepdim=True)
    has = x_max > uniform_tolerance(x.dtype) * mu  # else every weight is uniform up to rounding
    x_max = torch.where(has, x_max, torch.ones_like(x_max))
    r = x * (1.0 / x_max)  # in [0, 1]: r^p cannot overflow
    r_pm1 = None
    if want_pm1:  # r^(p-1) for the backward, and r^p from it with one multiply
        if p > 1:
            r_pm1 = ipow(r, p - 1)
        else:  # r^(p-1) is 1 (p = 1) or unbounded (p < 1) at r = 0, where dx must be 0
            r_pm1 = torch.where(r > 0, r.pow(p - 1), torch.zeros_like(r))
        w = r_pm1 * r
    else:
        w = ipow(r, p)
    w_sum = w.sum(-1, keepdim=True)
    if not bool(has.all()):  # rare: rows of equal weights fall back to LSSA
        w = torch.where(has, w, a)
        w_sum = torch.where(has, w_sum, z)
    return s, w, w_sum, (shift, big, has, x_max, r_pm1)


def row_scale(n: Tensor, scale: float, log_n: bool) -> Tensor:
    if log_n:  # c_i = ln(d) ln(N_i), ln(d) passed in as ``scale``
        return scale * torch.log(n.clamp_min(1.0))
    return torch.full_like(n, scale)
