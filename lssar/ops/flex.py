"""LSSA / LSSAR through PyTorch's FlexAttention (``impl="flex"``).

Softmax over ``log softplus(s)`` is the l1-normalised Softplus, so (docs/method.md sections 3-4)

- LSSA is ONE ``flex_attention`` call with ``score_mod = log softplus(c_i s_ij)``;
- LSSAR is two calls: the first also yields ``log Z_i`` (its log-sum-exp), hence
  ``mu_i = Z_i / N_i``; the second uses ``score_mod = p log(softplus(c_i s_ij) - mu_i)`` (``-inf``
  where the difference is not above the uniform tolerance ``tol * mu_i``), whose softmax is
  ``x^p / sum x^p`` exactly: softmax's own max-subtraction plays the role of ``r = x / x_max``.
  Rows where every entry is ``-inf`` (all visible Softplus values equal, up to rounding) take the
  first call's LSSA output, as the reference does.

``q`` and ``k`` are not normalised up front: the kernel's raw ``q.k`` is scaled inside the
score_mod by ``c_i / |q_i|`` and ``1 / |k_j|`` (captured fp32 vectors indexed by
``[b, h, q_idx]`` / ``[b, h_kv, kv_idx]``), so half-precision inputs are not rounded again after
normalisation. Causal (bottom-right aligned for ``T_q != T_k``) and boolean masks become a
``BlockMask``; ``N_i`` is counted in torch beforehand.

Limits (torch >= 2.9 for ``AuxRequest``; the registry lists the impl only when importable):

- CUDA: forward and backward (autograd through both calls, the log-sum-exp and the captured
  statistics). Half inputs follow FlexAttention's own precision (weights rounded for ``P @ V``).
- CPU: inference only, under ``torch.compile`` (FlexAttention's CPU kernels neither return the
  log-sum-exp nor run a backward): a call with gradients enabled for a tensor that requires grad
  raises ``RuntimeError``. ``Z_i`` comes from a sentinel key (score ``ln N_i``, value ``e_{D+1}``
  in an extra channel) instead of the log-sum-exp, and the fallback rows from an all-ones extra
  value channel. CPU computes in float32 (half inputs are upcast, the output cast back).
- float64: ``lssar.attention`` runs these inputs on ``impl="chunked"`` (same math); called
  directly, this function refuses them.
- No dropout; ``scale`` is rejected (the length scale is fixed by the variant).
- ``flex_attention`` is compiled with ``dynamic=False`` (dynamic shapes fail to lower on CPU in
  torch 2.13): every new shape / mask structure / variant costs a compilation (seconds on CPU),
  and past ``torch._dynamo.config.recompile_limit`` (default 8) entries torch falls back to the
  unfused eager FlexAttention. Raise that limit when sweeping many lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lssar.ops.common import (
    as_4d,
    centring_mean,
    inv_norm,
    length_scale,
    uniform_tolerance,
    visible_counts,
)
from lssar.ops.spans import KeySpans, span_counts
from lssar.ops.variants import Variant

try:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention (< 2.5) or without AuxRequest (< 2.9)
    flex_attention = None

UNIFORM_TOL = uniform_tolerance(torch.float32)  # the statistics are fp32, as in the kernels
SENTINEL_OFF = -1.0e4  # a score whose exp vanishes next to any real one (and fits in fp16)
_compiled: Callable[..., Any] | None = None
_BLOCK_MASKS: dict[tuple, Any] = {}  # causal / sentinel block masks by shape and device


def _flex() -> Callable[..., Any]:
    """``torch.compile(flex_attention)``, built on first use (compiling is lazy anyway)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _log_softplus(s: Tensor) -> Tensor:
    # log(softplus(s)) without log(0): softplus(s) = e^s (1 - e^s / 2 + ...) for s << 0; the
    # clamp keeps the unused branch (and so its gradient) finite
    return torch.where(s < -20.0, s, torch.log(F.softplus(s.clamp_min(-20.0))))


def _mask_mod(
    mask4: Tensor | None, is_causal: bool, t_q: int, t_k: int, sentinel: bool, spans=None
):
    """The visibility rule as a FlexAttention ``mask_mod`` (or None when everything is visible).

    ``sentinel``: key ``T_k`` (an extra key appended on CPU) is visible to every row. ``spans``
    (:class:`lssar.ops.spans.KeySpans`: documents, a window) bound each row's keys.
    """
    if mask4 is None and not is_causal and not sentinel and spans is None:
        return None
    off = t_k - t_q
    mb, mh, mq = (None, None, None) if mask4 is None else mask4.shape[:3]

    def mask_mod(b, h, q_idx, kv_idx):
        kv = kv_idx.clamp(max=t_k - 1)
        ok = kv_idx < t_k
        if is_causal:
            ok = ok & (kv_idx <= q_idx + off)
        if spans is not None:
            inside = (kv_idx >= spans.lo[q_idx]) & (kv_idx < spans.hi[q_idx])
            if spans.sink_lo is not None:
                inside = inside | (
                    (kv_idx >= spans.sink_lo[q_idx]) & (kv_idx < spans.sink_hi[q_idx])
                )
            ok = ok & inside
        if mask4 is not None:
            ok = ok & mask4[b if mb > 1 else 0, h if mh > 1 else 0, q_idx if mq > 1 else 0, kv]
        if sentinel:
            ok = ok | (kv_idx == t_k)
        return ok

    return mask_mod


def _block_mask(
    mask4: Tensor | None,
    is_causal: bool,
    b: int,
    h: int,
    t_q: int,
    t_k: int,
    device,
    sentinel,
    spans=None,
):
    """The ``BlockMask`` (None: all visible); masks that only depend on shapes are cached. With
    ``spans`` the blocks outside every row's spans are skipped."""
    mask_mod = _mask_mod(mask4, is_causal, t_q, t_k, sentinel, spans)
    if mask_mod is None:
        return None
    key = (is_causal, t_q, t_k, sentinel, str(device))
    shape_only = mask4 is None and spans is None
    if shape_only and key in _BLOCK_MASKS:
        return _BLOCK_MASKS[key]
    bb = b if mask4 is not None and mask4.shape[0] > 1 else None
    hh = h if mask4 is not None and mask4.shape[1] > 1 else None
    # compiled construction on GPU: the eager one materialises every (T_q, T_k) entry
    bm = create_block_mask(
        mask_mod,
        bb,
        hh,
        t_q,
        t_k + int(sentinel),
        device=device,
        _compile=torch.device(device).type == "cuda",
    )
    if shape_only:
        if len(_BLOCK_MASKS) >= 16:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        _BLOCK_MASKS[key] = bm
    return bm


def flex_attention_impl(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant: Variant,
    options: dict[str, Any],
    spans: KeySpans | None = None,
) -> Tensor:
    """LSSA / LSSAR on FlexAttention, with the contract of the reference attention.

    ``query (B, H_q, T_q, D)``, ``key (B, H_kv, T_k, D)``, ``value (B, H_kv, T_k, D_v)`` ->
    ``(B, H_q, T_q, D_v)`` in the input dtype; rows with ``N_i = 0`` are zero. See the module
    docstring for the CPU (inference-only) limits.
    """
    if flex_attention is None:
        raise RuntimeError("impl='flex' needs torch.nn.attention.flex_attention (torch >= 2.9)")
    if dropout_p > 0:
        raise ValueError("impl='flex' has no dropout; use impl='reference' for dropout_p > 0")
    if not variant.lssa_family:
        raise ValueError(f"impl='flex' runs lssa / lssar (+ any p), not {variant.name!r}")
    if scale is not None:
        raise ValueError("impl='flex' runs the length-scaled variants, which take no `scale`")
    if query.dtype == torch.float64:  # lssar.attention runs these on impl='chunked'
        raise ValueError(
            "impl='flex' has no float64 kernels; lssar.attention(..., impl='flex') runs float64 "
            "inputs on impl='chunked' (same math)"
        )
    on_cpu = query.device.type == "cpu"
    if on_cpu and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError(
            "impl='flex' on CPU is inference-only (FlexAttention has no CPU backward): "
            "wrap the call in torch.no_grad(), or use impl='chunked' / 'reference' for training"
        )
    dtype = query.dtype
    if on_cpu:  # detached: torch refuses CPU inputs that require grad even under no_grad
        query, key, value = (t.detach().to(torch.float32) for t in (query, key, value))
    B, H, t_q, d = query.shape
    hk, t_k = key.shape[1], key.shape[2]
    groups = H // hk
    mask4 = as_4d(attn_mask)
    if spans is None:
        n = visible_counts(mask4, is_causal, t_q, t_k, query.device)
    else:
        n = span_counts(spans, mask4)
    n = n.squeeze(-1).expand(B, H, t_q)
    inv_q, inv_k = inv_norm(query), inv_norm(key)  # (B, H, T_q), (B, H_kv, T_k)
    cq = length_scale(n, variant.scale_dim(d, options)) * inv_q  # c_i / |q_i|  (B, H, T_q)
    p = options.get("p")
    # LSSA needs no statistics: one call on every device; LSSAR on CPU cannot get the LSE
    fn = _sentinel_path if on_cpu and p is not None else _lse_path
    out = fn(query, key, value, mask4, is_causal, n, cq, inv_k, groups, p, enable_gqa, spans)
    return out.to(dtype)


def _scores(score, b, h, q_idx, kv_idx, cq, inv_k, groups):
    return score * cq[b, h, q_idx] * inv_k[b, h // groups, kv_idx]


def _sharpened_log(s: Tensor, mu: Tensor, p: float) -> Tensor:
    """``p log(softplus(s) - mu)``, ``-inf`` unless above ``tol * mu`` (un-centred if mu = 0)."""
    x = F.softplus(s) - mu
    keep = x > UNIFORM_TOL * mu
    centred = torch.log(torch.where(keep, x, 1.0))  # finite in both branches: no NaN gradient
    lx = torch.where(mu > 0, centred, _log_softplus(s))
    return torch.where(keep, p * lx, float("-inf"))


def _lse_path(q, k, v, mask4, is_causal, n, cq, inv_k, groups, p, gqa, spans):
    B, H, t_q, _ = q.shape
    t_k = k.shape[2]
    block_mask = _block_mask(mask4, is_causal, B, H, t_q, t_k, q.device, False, spans)
    flex = _flex()

    def lssa_mod(score, b, h, q_idx, kv_idx):
        return _log_softplus(_scores(score, b, h, q_idx, kv_idx, cq, inv_k, groups))

    kw = dict(block_mask=block_mask, scale=1.0, enable_gqa=gqa)
    if p is None:
        return flex(q, k, v, score_mod=lssa_mod, **kw)
    out1, aux1 = flex(q, k, v, score_mod=lssa_mod, return_aux=AuxRequest(lse=True), **kw)
    z = torch.exp(aux1.lse)  # (B, H, T_q); 0 for fully masked rows
    mu = centring_mean(z, n)

    def lssar_mod(score, b, h, q_idx, kv_idx):
        s = _scores(score, b, h, q_idx, kv_idx, cq, inv_k, groups)
        return _sharpened_log(s, mu[b, h, q_idx], p)

    out2, aux2 = flex(q, k, v, score_mod=lssar_mod, return_aux=AuxRequest(lse=True), **kw)
    has = torch.isfinite(aux2.lse).unsqueeze(-1)  # some x above the tolerance
    return torch.where(has, out2, out1)


def _sentinel_path(q, k, v, mask4, is_causal, n, cq, inv_k, groups, p, gqa, spans):
    B, H, t_q, d = q.shape
    hk, t_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    flex = _flex()
    with torch.no_grad():
        # Z_i without the log-sum-exp: a sentinel key with score ln N_i and value e_{D_v+1}
        # gets weight N_i / (Z_i + N_i) (comparable to the real mass: no cancellation).
        k1 = torch.cat([k, k.new_zeros(B, hk, 1, d)], 2)
        v1 = torch.cat([F.pad(v, (0, 1)), F.pad(v.new_ones(B, hk, 1, 1), (dv, 0))], 2)
        inv_k1 = F.pad(inv_k, (0, 1))
        log_n = torch.log(n.clamp_min(1.0))
        block_mask = _block_mask(mask4, is_causal, B, H, t_q, t_k, q.device, True, spans)

        def lssa_mod(score, b, h, q_idx, kv_idx):
            s = _log_softplus(_scores(score, b, h, q_idx, kv_idx, cq, inv_k1, groups))
            return torch.where(kv_idx == t_k, log_n[b, h, q_idx], s)

        o1 = flex(q, k1, v1, score_mod=lssa_mod, block_mask=block_mask, scale=1.0, enable_gqa=gqa)
        sent = o1[..., dv]  # N / (Z + N)
        real = (1.0 - sent).unsqueeze(-1)  # Z / (Z + N)
        out1 = o1[..., :dv] / torch.where(real > 0, real, torch.ones_like(real))
        z = n * (1.0 - sent) / sent
        mu = centring_mean(z, n)
        # second call: an all-ones extra value channel reads 1 where the row has any finite
        # score, 0 (or NaN) where every score is -inf: those rows fall back to LSSA
        v2 = F.pad(v, (0, 1), value=1.0)
        block_mask = _block_mask(mask4, is_causal, B, H, t_q, t_k, q.device, False, spans)

        def lssar_mod(score, b, h, q_idx, kv_idx):
            s = _scores(score, b, h, q_idx, kv_idx, cq, inv_k, groups)
            return _sharpened_log(s, mu[b, h, q_idx], p)

        o2 = flex(q, k, v2, score_mod=lssar_mod, block_mask=block_mask, scale=1.0, enable_gqa=gqa)
        has = (o2[..., dv] > 0.5).unsqueeze(-1)
        return torch.where(has, o2[..., :dv], out1)


__all__ = ["flex_attention_impl"]
