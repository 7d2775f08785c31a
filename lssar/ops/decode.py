"""A decode step of the softplus-l1 family: a few new queries, no gradient, over a KV cache.

``impl="cpu"`` takes :func:`softplus_decode_op` (the fused kernel's decode entry, registered as
``lssar::softplus_decode``) where :func:`decode_applies`, ``impl="chunked"`` the same arithmetic
in torch ops (:func:`_eager_decode`, also ``cpu``'s fallback) where :func:`is_decode_step`.
Both read the cache as it is (GQA without repeating it, each key's inverse norm from one pass,
:func:`key_inverse_norms` being what a cache keeps) and weigh the keys by the rule of
:mod:`lssar.ops.weights`. :mod:`lssar.ops.chunked` routes its decode calls here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lssar.ops.common import (
    REWEIGHT_MIN_KEYS,
    as_4d,
    combined_mask,
    compute_dtype,
    count_visible,
    separate_rows,
    uniform_tolerance,
    unit,
)
from lssar.ops.cpu.unit import unit_no_grad
from lssar.ops.spans import block_visibility
from lssar.ops.weights import row_scale, softplus_weights

# A decode step (``impl="cpu"``, no gradient): at most this many new queries go to the kernel's
# decode entry, which reads the cache in place, normalises each key as it reads it and cuts the
# keys into chunks of DECODE_KEY_CHUNK, one task each (so one head's cache uses every thread)
DECODE_MAX_ROWS, DECODE_KEY_CHUNK = 16, 1024


def is_decode_step(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """At most :data:`DECODE_MAX_ROWS` queries and no gradient to record: a ``chunked`` call
    then takes :func:`_eager_decode` (which lets no masked key or value into a result)."""
    return query.shape[-2] <= DECODE_MAX_ROWS and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    )


def decode_applies(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether a ``cpu`` call goes to the fused kernel's decode entry (:func:`softplus_decode_op`):
    a decode step (:func:`is_decode_step`) on CPU in float32, bf16 or fp16 (the kernel converts
    a half-precision cache chunk by chunk as it reads it), keys and values with unit last stride
    (a KV cache's buffers as they are)."""
    return (
        is_decode_step(query, key, value)
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


def key_inverse_norms(k: Tensor) -> Tensor:
    """``1 / ||k_j||`` per key, float32 ``(.., T_k)`` (0 for a zero or non-finite key): what a KV
    cache keeps for :func:`lssar.attention`'s ``key_norms``."""
    return _inverse_norms(k.float())[0]


def _inverse_norms(k: Tensor) -> tuple[Tensor, Tensor]:
    """``(1 / ||k_j||`` per key ``(.., T_k)``, ``k``) from one pass over ``k``: a zero key gets 0
    (cosine 0, as :func:`lssar.ops.common.unit` makes it). Where some key's squares could over-
    or underflow, or it holds NaN / inf (rare), unit's scaled form, and the non-finite keys
    zeroed in the returned ``k``, as unit zeroes them."""
    norm = torch.linalg.vector_norm(k, dim=-1)
    ok = (norm < 1e15) & ((norm > 1e-15) | (norm == 0))
    if not bool(ok.all()):
        big = k.abs().amax(-1)
        big = torch.where((big > 0) & torch.isfinite(big), big, torch.ones_like(big))
        norm = torch.linalg.vector_norm(k / big.unsqueeze(-1), dim=-1) * big
        k = torch.where(torch.isfinite(norm).unsqueeze(-1), k, torch.zeros_like(k))
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    return torch.where(norm > 0, 1.0 / norm.clamp_min(torch.finfo(norm.dtype).tiny), 0.0), k


def _eager_decode(q, k, v, mask, is_causal, scale, log_n, qk_norm, p) -> Tensor:
    """The decode entry's arithmetic in torch ops (``chunked``, and ``cpu`` where its kernel
    cannot run): a kv head's query heads as one block of rows (GQA without repeating the cache),
    each key's inverse norm from one pass over K, the scores from one product on the raw keys,
    and only V's masked rows zeroed (a masked key's score is selected out). ``q`` as for
    :func:`softplus_decode_op`; the output in the compute dtype (float64 for float64)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, hq, t_q, d = q.shape
    hk, t_k = k.shape[1], k.shape[2]
    rows = hq // hk * t_q  # the query heads of a kv head, stacked
    qg = q.to(dtype).reshape(B, hk, rows, d)
    kf, vf = k.to(dtype), v.to(dtype)
    m = combined_mask(as_4d(mask), is_causal, t_q, t_k, q.device)
    if m is not None:
        m = as_4d(m).expand(B, hq, t_q, t_k).reshape(B, hk, rows, t_k)
        vf = torch.where(m.any(-2).unsqueeze(-1), vf, torch.zeros_like(vf))
    n = count_visible(m, t_k).to(dtype) if m is not None else qg.new_full((1, 1, 1, 1), t_k)
    c = row_scale(n, scale, log_n)
    if qk_norm:
        inv, kf = _inverse_norms(kf)
        c = c * inv.unsqueeze(-2)  # (B, H_k, rows, T_k): the cosine's scale per key
    _, num, den, _ = softplus_weights(qg, c, kf, m, n, p)
    return ((num @ vf) / den).reshape(B, hq, t_q, v.shape[-1])


def _decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    qk_norm: bool,
    p: float | None,
    k_inv: Tensor | None = None,
) -> Tensor:
    """The decode step, registered as the op :data:`softplus_decode_op`; eager calls run it
    directly (the op's dispatch cost a third of a step's time at 1K keys; it has no gradient to
    record).

    A few float32 queries ``q (B, H_q, T_q, D)`` (unit vectors when ``qk_norm``) over a cache
    ``k (B, H_k, T_k, D)``, ``v (B, H_k, T_k, D_v)`` of raw keys (float32, bf16 or fp16), ``H_q``
    a multiple of ``H_k``; the output in float32. Each key and value is read once, in place, by
    the fused kernel's decode entry, which reads no masked key or value
    (:func:`lssar.ops.api.attention` leaves them as they are) and takes the keys' inverse
    norms from ``k_inv (B, H_k, T_k)`` where the cache keeps them; where that kernel cannot run
    (not built, or a row whose every softplus underflowed), :func:`_eager_decode`."""
    from lssar.ops.cpu.build import kernel

    B, hq, t_q, _ = q.shape
    mod = kernel()
    if mod is not None:
        # the entry reads a float32 cache in place and takes rows that lie apart (it refuses
        # an unfolded or time-expanded view: a copy)
        k = separate_rows(k) if k.dtype == torch.float32 else k
        m4 = None if mask is None else as_4d(mask).expand(B, hq, t_q, k.shape[2])
        rule = (-1.0 if p is None else p, float(REWEIGHT_MIN_KEYS), uniform_tolerance(q.dtype))
        tensors = (q.contiguous(), k, v, k_inv if qk_norm else None, m4)
        out, underflow = mod.decode(
            *tensors, is_causal, scale, log_n, qk_norm, *rule, DECODE_KEY_CHUNK
        )
        if not underflow:
            return out
    return _eager_decode(q, k, v, mask, is_causal, scale, log_n, qk_norm, p)


# the decode step as an op (what torch.compile traces), its schema from _decode's signature
softplus_decode_op = torch.library.custom_op("lssar::softplus_decode", _decode, mutates_args=())


@softplus_decode_op.register_fake
def _softplus_decode_fake(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, k_inv=None):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])  # float32, as q


def decode_step(
    query, key, value, mask, is_causal, c, log_n, qk_norm, p, spans, fused, key_norms=None
) -> Tensor:
    """A decode step: :func:`softplus_decode_op` (``fused``, where :func:`decode_applies`; with
    the cache's ``key_norms`` if given) or :func:`_eager_decode`; with ``spans`` over only the keys
    the rows may see (a view of the cache for documents and windows)."""
    dtype = value.dtype
    eager = fused and not torch.compiler.is_compiling()
    if not qk_norm:
        query = query.to(compute_dtype(query.dtype))
    else:  # on the kernel's unit_forward in eager fused calls (unit's dozen ops: 40 us a step)
        query = unit_no_grad(query) if eager else unit(query)
    if spans is not None:
        keys, mask = block_visibility(spans, as_4d(mask), 0, query.shape[-2])
        if keys is None:  # no row sees a key
            return value.new_zeros(query.shape[:-1] + value.shape[-1:])
        key, value, is_causal = key[:, :, keys], value[:, :, keys], False
        key_norms = None if key_norms is None else key_norms[:, :, keys]
    args = (query, key, value, mask, is_causal, c, log_n, qk_norm, p)
    if not fused:
        out = _eager_decode(*args)
    else:
        out = (_decode if eager else softplus_decode_op)(*args, key_norms)
    return out.to(dtype)
