"""Name -> variant, impl -> function; ``impl="auto"`` picks the best implementation available."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lssar.ops.chunked import chunked_attention
from lssar.ops.common import as_4d, check_inputs, hide_unseen
from lssar.ops.reference import reference_attention
from lssar.ops.sdpa import sdpa_attention
from lssar.ops.variants import VARIANTS, Variant

# Below this many score entries per (batch, head) the materialised reference is as fast (measured
# on 2 CPU cores: equal at T = 128, chunked 2-3x faster fwd+bwd at T = 256).
AUTO_CHUNK_MIN_SCORES = 128 * 128


def _softplus_l1(v: Variant, opts: dict[str, Any]) -> bool:
    return v.softplus_l1


def _softmax_family(v: Variant, opts: dict[str, Any]) -> bool:
    return v.phi == "exp" and opts.get("p") is None


# impl name -> (implementation, which variants/options it supports, what it needs)
IMPLS: dict[str, tuple[Callable[..., Tensor], Callable[[Variant, dict], bool], str]] = {
    "reference": (reference_attention, lambda v, o: True, "materialised T_q x T_k, every variant"),
    "chunked": (
        chunked_attention,
        _softplus_l1,
        "memory-efficient exact softplus-l1 family (lssa, lssar, softplus-l1; any p)",
    ),
    "sdpa": (
        sdpa_attention,
        _softmax_family,
        "torch SDPA kernels for softmax, ssmax, softmax-qknorm-logn (no p)",
    ),
}


def register_impl(
    name: str, fn: Callable[..., Tensor], supports: Callable[[Variant, dict], bool], summary: str
) -> None:
    """Add an implementation (e.g. the Triton kernels register themselves here when importable)."""
    IMPLS[name] = (fn, supports, summary)


def get_variant(name: str) -> Variant:
    """The :class:`Variant` called ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention variant {name!r}; valid variants: {', '.join(VARIANTS)}"
        ) from None


def variants() -> list[dict[str, Any]]:
    """Every variant: name, one-line summary, options with defaults, and the impls that run it."""
    return [
        {
            "name": v.name,
            "summary": v.summary,
            "options": dict(v.options),
            "impls": [name for name, (_, ok, _) in IMPLS.items() if ok(v, v.options)],
        }
        for v in VARIANTS.values()
    ]


def _functorch_active() -> bool:
    """Inside torch.func.grad / vmap / jacrev: the fused kernels' autograd formulas do not
    compose with these transforms, the reference's autograd does."""
    return bool(torch._C._are_functorch_transforms_active())


def _auto(
    query: Tensor, key: Tensor, dropout_p: float, variant: Variant, opts: dict[str, Any]
) -> str:
    if dropout_p > 0 or (_functorch_active() and not _softmax_family(variant, opts)):
        return "reference"
    if query.is_cuda and "triton" in IMPLS and IMPLS["triton"][1](variant, opts):
        return "triton"
    if _softmax_family(variant, opts):
        return "sdpa"
    if _softplus_l1(variant, opts) and query.shape[-2] * key.shape[-2] >= AUTO_CHUNK_MIN_SCORES:
        return "chunked"
    return "reference"


def resolve(
    variant: str, impl: str, query: Tensor, key: Tensor, dropout_p: float, options: dict[str, Any]
) -> tuple[Variant, str, dict[str, Any]]:
    """Validate names and options; return ``(variant, impl name, resolved options)``."""
    v = get_variant(variant)
    opts = v.resolve(options)
    if impl == "auto":
        impl = _auto(query, key, dropout_p, v, opts)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid impls: auto, {', '.join(IMPLS)}")
    if not IMPLS[impl][1](v, opts):
        ok = [n for n, (_, sup, _) in IMPLS.items() if sup(v, opts)]
        raise ValueError(
            f"impl {impl!r} does not run variant {v.name!r} with options {opts}; "
            f"use one of: auto, {', '.join(ok)}"
        )
    if impl in ("chunked", "triton") and _functorch_active():
        raise ValueError(
            f"impl={impl!r} does not run under torch.func transforms (grad, vmap, jacrev); "
            "use impl='auto' or impl='reference' there"
        )
    return v, impl, opts


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant: str = "lssar",
    impl: str = "auto",
    **options: Any,
) -> Tensor:
    """Attention with the paper's variants behind SDPA's signature.

    Args:
        query: ``(B, H_q, T_q, D)``; key: ``(B, H_kv, T_k, D)``; value: ``(B, H_kv, T_k, D_v)``.
        attn_mask: boolean, ``True`` = may attend, broadcastable to ``(B, H_q, T_q, T_k)``; may be
            combined with ``is_causal`` (padding + causal).
        dropout_p: dropout on the final weights (``impl="reference"``; auto picks it).
        is_causal: causal mask, bottom-right aligned: query ``t`` of a length-``T_q`` block sits at
            absolute position ``T_k - T_q + t`` (KV cache) and sees keys ``0 .. T_k - T_q + t``.
            For ``T_q == T_k`` this is SDPA's causal mask; for ``T_q != T_k`` SDPA aligns top-left.
        scale: ``c`` in ``c q.k`` for the ``1/sqrt(d)`` variants (default ``1/sqrt(D)``); the
            length-scaled variants (lssa, lssar, softmax-qknorm-logn) use ``ln(D) ln(N_i)`` and
            reject ``scale``.
        enable_gqa: grouped-query attention, ``H_q`` divisible by ``H_kv``.
        variant: a name from :func:`variants` (``"lssar"``, ``"lssa"``, ``"softmax"``, ...).
        impl: ``"auto"``, ``"reference"``, ``"chunked"``, ``"sdpa"`` (and ``"triton"``,
            ``"flex"`` where available).
        **options: the variant's own keyword options (e.g. ``p`` for re-weighting).

    Returns:
        ``(B, H_q, T_q, D_v)`` in the input dtype. ``N_i`` is the number of keys row ``i`` may
        attend to; rows with ``N_i = 0`` (including ``T_k = 0``) are zero (never NaN), and masked
        keys, values and queries are never read (NaN padding cannot leak). Normalisation and
        statistics are computed in float32 for half-precision inputs.
    """
    check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    v, impl, opts = resolve(variant, impl, query, key, dropout_p, options)
    attn_mask = as_4d(attn_mask)
    if attn_mask is not None and attn_mask.shape[-1] == 1 and key.shape[-2] > 1:
        attn_mask = attn_mask.expand(*attn_mask.shape[:-1], key.shape[-2])  # a view: no memory
    if key.shape[-2] == 0 or query.shape[-2] == 0:  # N_i = 0 everywhere: zeros, zero gradients
        empty = query[..., :0].sum() + key.sum() + value.sum()  # 0, keeps the graph
        return empty + query.new_zeros(query.shape[:-1] + value.shape[-1:])
    query, key, value = hide_unseen(query, key, value, attn_mask, is_causal)
    if scale is not None and v.scaling == "log_n":
        raise ValueError(
            f"variant {v.name!r} uses the length scale ln(D) ln(N_i) and takes no `scale`; "
            "pass scale=None"
        )
    if "s" in opts and hasattr(opts["s"], "dim") and opts["s"].dim() == 1:
        if opts["s"].shape[0] not in (1, query.shape[1]):
            raise ValueError(
                f"ssmax `s` must have one entry per query head ({query.shape[1]}), "
                f"got shape {tuple(opts['s'].shape)}"
            )
    fn = IMPLS[impl][0]
    return fn(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        variant=v,
        options=opts,
    )


# Optional implementations register themselves (after register_impl exists: they import it).
if importlib.util.find_spec("triton") is not None:
    import lssar.ops.triton_kernels  # noqa: E402,F401  (impl "triton")
import lssar.ops.flex  # noqa: E402,F401  (impl "flex", where FlexAttention exists)
