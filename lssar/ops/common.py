"""Argument checks, masks and row statistics shared by every attention implementation.

Conventions (all implementations):
- layout ``[B, H, T, D]``; ``key``/``value`` may have fewer heads than ``query`` when
  ``enable_gqa=True`` (``H_q`` divisible by ``H_kv``; head ``h`` reads kv head ``h // (H_q/H_kv)``,
  as in SDPA).
- ``attn_mask`` is boolean, ``True`` = may attend, broadcastable to ``[B, H, T_q, T_k]``; it can be
  combined with ``is_causal`` (unlike SDPA, both may be given: padding + causal).
- causal alignment when ``T_q != T_k`` (KV cache): query ``t`` of a length-``T_q`` block sits at
  absolute position ``T_k - T_q + t`` and sees keys ``0 .. T_k - T_q + t`` (bottom-right, as
  FlashAttention >= 2.1; SDPA's ``is_causal`` is top-left, so it differs from SDPA only there).
- ``N_i`` = number of keys query ``i`` may attend to under the combined mask.
- rows with ``N_i = 0`` produce zeros and zero gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def finite(x: float) -> bool:
    """``math.isfinite`` by comparisons: under ``torch.compile(dynamic=True)`` a float option is
    symbolic, and compares (a guard) but has no ``isfinite``. NaN fails both comparisons."""
    return -math.inf < x < math.inf


def check_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> None:
    """Raise a ``ValueError`` naming the argument when the inputs break the attention contract."""
    # flags are bools, as in SDPA: a truthy int, string or tensor was read as causal by some
    # implementations and refused by others
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool (True or False), got {flag!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims [B, H, T, D], got shape {tuple(t.shape)}; "
                "for [B, T, H, D] inputs call .transpose(1, 2) first"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    dtypes = (query.dtype, key.dtype, value.dtype)
    # under autocast mixed inputs are legal, as for SDPA: attention() casts them all to
    # autocast's dtype (HF models feed float32 rotated q, k beside a bf16 v); float64 is never cast
    mixed_ok = autocast_dtype(query.device.type) is not None and torch.float64 not in dtypes
    if len(set(dtypes)) > 1 and not mixed_ok:
        raise ValueError(
            f"query, key, value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError("query, key, value must be on the same device")
    bq, hq, _, dq = query.shape
    bk, hk, tk, dk = key.shape
    bv, hv, tv, _ = value.shape
    if not (bq == bk == bv):
        raise ValueError(f"batch sizes differ: query {bq}, key {bk}, value {bv}")
    if dq != dk:
        raise ValueError(f"query and key head dims differ: {dq} vs {dk}")
    if dq == 0 or value.shape[-1] == 0:
        raise ValueError(
            f"head dims must be >= 1, got query/key D = {dq}, value D_v = {value.shape[-1]}"
        )
    if (hk, tk) != (hv, tv):
        raise ValueError(
            f"key and value must share heads and length, got key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}"
        )
    if hq != hk:
        if not enable_gqa:
            raise ValueError(
                f"query has {hq} heads but key/value have {hk}; pass enable_gqa=True for "
                "grouped-query attention"
            )
        if hq % hk:
            raise ValueError(
                f"enable_gqa needs query heads ({hq}) divisible by key/value heads ({hk})"
            )
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
            got = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
            raise ValueError(
                f"attn_mask must be a boolean tensor (True = may attend), got {got}; "
                "convert an additive float mask with `mask == 0`"
            )
        if attn_mask.dim() > 4:
            raise ValueError(f"attn_mask must have at most 4 dims, got {attn_mask.dim()}")
        target = (bq, hq, query.shape[2], tk)
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:  # broadcasting *with* the scores would widen the output: refuse
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"[B, H, T_q, T_k] = {list(target)}; each of its dims must be 1 or match "
                "(a decode step with T_q = 1 needs the mask's last query row: mask[..., -1:, :])"
            )
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and finite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs lower-precision ops in on ``device_type``; None when it is off
    (or the device has no autocast)."""
    if not (
        torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    ):
        return None
    return torch.get_autocast_dtype(device_type)


def causal_mask(t_q: int, t_k: int, device: torch.device, q_start: int = 0) -> Tensor:
    """Causal visibility ``(t_q, t_k)`` of query rows at absolute positions ``q_start + i``.

    Row ``i`` sees key ``j`` iff ``j <= q_start + i``. For a whole block of ``T_q`` queries over
    ``T_k`` keys (bottom-right alignment) ``q_start = T_k - T_q``.
    """
    i = torch.arange(t_q, device=device).unsqueeze(-1) + q_start
    j = torch.arange(t_k, device=device)
    return j <= i  # (t_q, t_k)


def combined_mask(
    attn_mask: Tensor | None, is_causal: bool, t_q: int, t_k: int, device: torch.device
) -> Tensor | None:
    """The full boolean visibility mask (broadcastable to ``[B, H, T_q, T_k]``) or ``None``."""
    mask = causal_mask(t_q, t_k, device, q_start=t_k - t_q) if is_causal else None
    if attn_mask is not None:
        mask = attn_mask if mask is None else (attn_mask & mask)
    return mask


def as_4d(mask: Tensor | None) -> Tensor | None:
    """A 0- to 4-dim mask viewed as 4-dim (leading size-1 axes)."""
    if mask is None:
        return None
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def count_visible(mask: Tensor, t_k: int) -> Tensor:
    """``N_i = sum_j mask_ij`` as float32 ``(.., T_q|1, 1)``, counting the mask *broadcast* to
    ``t_k`` keys: a size-1 key axis (``True`` of shape ``[]``, ``[T_q, 1]``) stands for ``t_k``."""
    n = mask.sum(-1, keepdim=True, dtype=torch.float32)
    return n * t_k if mask.shape[-1] == 1 and t_k != 1 else n


def visible_counts(
    attn_mask: Tensor | None,
    is_causal: bool,
    t_q: int,
    t_k: int,
    device: torch.device,
    q_start: int | None = None,
) -> Tensor:
    """``N_i``: the keys ``0 .. t_k - 1`` each query row may attend to, float32 ``(B|1, H|1,
    T_q|1, 1)`` (exact below 2**24). The one definition every implementation uses.

    ``attn_mask`` is the caller's boolean mask (0- to 4-dim, not yet combined with the causal
    rule), counted on its broadcast to ``t_k`` keys. With ``is_causal`` row ``i`` sits at absolute
    position ``q_start + i`` (default ``t_k - t_q``: a whole block, bottom-right aligned) and sees
    keys ``j <= q_start + i``. Causal and key padding alone never build a ``(T_q, T_k)`` temporary.
    """
    mask = as_4d(attn_mask)
    if not is_causal:
        if mask is None:
            return torch.full((1, 1, 1, 1), float(t_k), device=device)
        return count_visible(mask, t_k)
    start = t_k - t_q if q_start is None else q_start
    last = torch.arange(t_q, device=device) + start  # the last key each row may see
    if mask is None:
        return (last + 1).clamp(0, t_k).to(torch.float32).reshape(1, 1, -1, 1)
    if mask.shape[-2] == 1 and t_k > 0:  # key padding + causal: prefix sums over the keys
        keys = mask[..., 0, :].expand(*mask.shape[:-2], t_k)  # (B|1, H|1, T_k)
        cs = keys.cumsum(-1, dtype=torch.float32)
        n = cs.index_select(-1, last.clamp(0, t_k - 1))
        return torch.where(last >= 0, n, torch.zeros_like(n)).unsqueeze(-1)
    return count_visible(mask & causal_mask(t_q, t_k, device, q_start=start), t_k)


# Re-weighting (docs/method.md section 4): O_i = 1, i.e. rows are centred on their mean weight, only
# for rows with more than this many visible keys; rows with N_i <= 3 are sharpened un-centred.
REWEIGHT_MIN_KEYS = 3


def centred_rows(n: Tensor) -> Tensor:
    """``O_i = 1`` as a boolean of ``n`` (``N_i``, any shape): ``N_i > REWEIGHT_MIN_KEYS``."""
    return n > REWEIGHT_MIN_KEYS


def centring_mean(z: Tensor, n: Tensor) -> Tensor:
    """``mu_i = Z_i / N_i`` (mean Softplus over visible keys) where ``O_i = 1``, else 0.

    Subtracting ``mu_i`` from ``softplus(s_ij)`` is docs/method.md's ``N_i A_ij - O_i`` divided by
    ``N_i / Z_i``: the same re-weighted row (``z``, ``n`` broadcast against each other)."""
    return torch.where(centred_rows(n), z / n.clamp_min(1.0), torch.zeros_like(z))


NORM_EPS = 1e-12  # F.normalize's eps: x / max(||x||, eps)


def inv_norm(x: Tensor) -> Tensor:
    """``1 / max(||x||, NORM_EPS)`` over the last dim in float32: ``(B, H, T)``, contiguous.

    For kernels that scale a raw ``q . k`` by the inverse norms instead of normalising first
    (callers divide each vector by a power of two near its largest entry beforehand, so the
    norm neither overflows nor reaches the eps); :func:`unit` is the normalised vector itself.
    """
    norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    return (1.0 / norm.clamp_min(NORM_EPS)).contiguous()


def unit(x: Tensor) -> Tensor:
    """``x / ||x||`` over the last dim in the compute dtype, robust at every scale.

    The vector is first divided by its largest magnitude (a constant for the gradient: the result
    is scale-invariant), so tiny (< 1e-12) and huge (> 1e19 in fp32, 1e4 in fp16) vectors keep
    their direction. A zero vector gives zeros (cosine 0 with everything, so a uniform row for the
    softplus/softmax variants) and a zero gradient.
    """
    x = x.to(compute_dtype(x.dtype))
    big = x.detach().abs().amax(-1, keepdim=True)
    finite_nonzero = (big > 0) & torch.isfinite(big)
    y = x / torch.where(finite_nonzero, big, torch.ones_like(big))
    norm = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    ok = norm > 0
    if not (torch.is_grad_enabled() and x.requires_grad):
        # no graph to keep (inference, a decode step over a whole cache): the same arithmetic in
        # place on ``y``, bit for bit, without three more cache-sized temporaries
        return y.div_(torch.where(ok, norm, torch.ones_like(norm))).masked_fill_(~ok, 0.0)
    return torch.where(ok, y / torch.where(ok, norm, torch.ones_like(norm)), torch.zeros_like(y))


def hide_unseen(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Zero the keys/values no query may see and the queries that see no key.

    Masked entries are never read into the result: padding filled with NaN or inf cannot reach a
    visible row (``0 * nan`` would, in a matmul), and a fully masked row is exactly zero whatever
    its query holds. Gradients to the hidden entries are zero. ``mask`` is 4-dim or None.
    """
    if mask is None:
        return query, key, value
    t_q, t_k = query.shape[-2], key.shape[-2]
    if mask.shape[-2] == 1 and is_causal and t_k > 0:  # key padding + causal, without T_q x T_k
        # the last row sees every key; row i sees one iff the first visible key is <= T_k-T_q+i
        seen_k = mask.transpose(-1, -2)
        first = torch.where(mask, torch.arange(mask.shape[-1], device=mask.device), t_k).amin(-1)
        rows = torch.arange(t_q, device=mask.device) + (t_k - t_q)
        seen_q = (first <= rows).unsqueeze(-1)  # (B|1, H|1, T_q, 1)
    else:
        full = combined_mask(mask, is_causal, t_q, t_k, mask.device)
        seen_k = full.any(-2, keepdim=True).transpose(-1, -2)  # (B|1, H|1, T_k|1, 1)
        seen_q = full.any(-1, keepdim=True)  # (B|1, H|1, T_q|1, 1)
    return zero_unseen(query, key, value, seen_q, seen_k)


def zero_unseen(
    query: Tensor, key: Tensor, value: Tensor, seen_q: Tensor, seen_k: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The queries where ``seen_q`` ``(B|1, H_q|1, T_q|1, 1)`` holds, and the keys and values
    where ``seen_k`` ``(B|1, H|1, T_k|1, 1)`` (per query head or kv head) holds; zeros elsewhere."""
    hq, hk = query.shape[1], key.shape[1]
    if seen_k.shape[1] == hq and hq != hk:  # GQA: a kv head is seen if any of its group sees it
        seen_k = seen_k.reshape(seen_k.shape[0], hk, hq // hk, *seen_k.shape[2:]).any(2)
    # unconditional: skipping the select when nothing is hidden needs the mask's content on the
    # host (a sync on GPU, a graph break under torch.compile), and the select is O(T D) next to
    # attention's O(T^2 D)
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    key, value = torch.where(seen_k, key, zero), torch.where(seen_k, value, zero)
    return torch.where(seen_q, query, zero), key, value


def expand_kv(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Repeat key/value heads for GQA (differentiable: dk/dv sum over each group)."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are computed in float32 for half inputs; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def length_scale(n: Tensor, d: int) -> Tensor:
    """LSSA's length scale ``c_i = ln(d) * ln(N_i)`` (0 for rows with ``N_i <= 1``)."""
    return math.log(d) * torch.log(n.clamp_min(1.0))


def log_phi(s: Tensor, phi: str) -> Tensor:
    """``log(phi(s))`` for softplus and sigmoid without underflow: ``softplus(s) = e^s (1 - ...)``
    and ``sigmoid(s) = e^s (1 - ...)`` for ``s << 0``. An l1 row normalised as
    ``exp(log_phi - max log_phi)`` is the same row, and cannot underflow to all zeros (fp32 does
    below ``s ~ -104``). The clamp keeps the unused branch, and so its gradient, finite."""
    if phi == "sigmoid":
        return F.logsigmoid(s)
    return torch.where(s < -30.0, s, torch.log(F.softplus(s.clamp_min(-30.0))))


def uniform_tolerance(dtype: torch.dtype) -> float:
    """Relative deviation from the row mean below which a row counts as uniform.

    ``N_i A_ij - 1`` of a row of equal weights is rounding noise, not signal; raising noise to the
    power ``p`` would pick an arbitrary key. Rows whose largest deviation is within
    ``64 * eps`` of the mean fall back to the LSSA weights (docs/method.md section 4, 0/0 case).
    """
    return 64.0 * torch.finfo(dtype).eps


def check_alibi(alibi_slopes: Tensor | None, query: Tensor) -> None:
    """``alibi_slopes`` (ALiBi, Press et al. 2022) is None or a finite float tensor of shape
    ``(H_q,)`` or ``(B, H_q)`` on the query's device: one slope per query head (and batch row),
    as FlashAttention's ``alibi_slopes``. ``ValueError`` naming it otherwise."""
    if alibi_slopes is None:
        return
    b, h = query.shape[0], query.shape[1]
    if not isinstance(alibi_slopes, Tensor) or not alibi_slopes.is_floating_point():
        got = alibi_slopes.dtype if isinstance(alibi_slopes, Tensor) else type(alibi_slopes)
        raise ValueError(f"alibi_slopes must be a float tensor of shape (H,) or (B, H), got {got}")
    if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise ValueError(
            f"alibi_slopes must have shape (H,) = ({h},) or (B, H) = ({b}, {h}), got "
            f"{tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != query.device:
        raise ValueError("alibi_slopes must be on the same device as query")
    if not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError("alibi_slopes must be finite")


def alibi_bias(slopes: Tensor, q_pos: Tensor, keys: int | Tensor, dtype: torch.dtype) -> Tensor:
    """ALiBi's score bias ``-slope_h * |q_pos_i - j|`` over keys ``j = 0 .. keys - 1`` (or the key
    positions ``keys``, an int64 vector): ``(B|1, H, T_q, len(keys))`` in ``dtype``.

    ``q_pos (T_q,)`` are the query rows' absolute positions: ``T_k - T_q + i`` for a whole block
    (bottom-right, the causal convention, as FlashAttention's ALiBi), so a KV-cache step gets the
    same bias as the full sequence. Distances are exact integers in float32 below 2**24.
    """
    s = slopes.to(dtype)
    s = s.reshape(1, -1, 1, 1) if s.dim() == 1 else s[:, :, None, None]
    if isinstance(keys, int):
        j = torch.arange(keys, device=q_pos.device, dtype=dtype)
    else:
        j = keys.to(dtype)
    return -s * (q_pos.to(dtype)[:, None] - j[None, :]).abs()  # (B|1, H, T_q, T_k)
