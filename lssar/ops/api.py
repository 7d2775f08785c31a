"""The public op: :func:`attention`, the paper's variants behind SDPA's signature.

It checks the arguments once (:func:`lssar.ops.common.check_inputs`), turns documents and
windows into key spans (:mod:`lssar.ops.spans`), settles autocast, asks the registry
(:func:`lssar.ops.registry.resolve`) which implementation runs, zeroes what no row may see unless
that implementation reads none of it, and calls the implementation with the one signature they
all share. Adding a kernel or a variant never touches this module: both live in the registry.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lssar.ops.common import as_4d, autocast_dtype, check_alibi, check_inputs, hide_unseen
from lssar.ops.registry import BACKENDS, get_variant, resolve
from lssar.ops.spans import KeySpans, hide_unseen_spans, key_spans

__all__ = ["attention"]


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
    impl_options: dict[str, Any] | None = None,
    alibi_slopes: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    sink_tokens: int = 0,
    key_norms: Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Attention with the paper's variants behind SDPA's signature.

    Args:
        query: ``(B, H_q, T_q, D)``; key: ``(B, H_kv, T_k, D)``; value: ``(B, H_kv, T_k, D_v)``.
        attn_mask: boolean, ``True`` = may attend, broadcastable to ``(B, H_q, T_q, T_k)``; may be
            combined with ``is_causal`` (padding + causal).
        dropout_p: dropout on the final weights (``impl="reference"`` and ``"sdpa"``; auto picks
            the reference); other impls raise a ``ValueError``.
        is_causal: causal mask, bottom-right aligned: query ``t`` of a length-``T_q`` block sits at
            absolute position ``T_k - T_q + t`` (KV cache) and sees keys ``0 .. T_k - T_q + t``.
            For ``T_q == T_k`` this is SDPA's causal mask; for ``T_q != T_k`` SDPA aligns top-left.
        scale: ``c`` in ``c q.k`` for the ``1/sqrt(d)`` variants (default ``1/sqrt(D)``); the
            length-scaled variants (lssa, lssar, softmax-qknorm-logn) use ``ln(D) ln(N_i)``, the
            constant-scale ones (softmax-qknorm-const / -learned, lssa-const) ``ln(D) ln(n)``,
            and reject ``scale``.
        enable_gqa: grouped-query attention, ``H_q`` divisible by ``H_kv``.
        variant: a name from :func:`lssar.variants` (``"lssar"``, ``"lssa"``, ``"softmax"``, ...).
        impl: ``"auto"``, ``"reference"``, ``"chunked"``, ``"sdpa"`` (and ``"triton"``,
            ``"flex"`` where available; :func:`lssar.ops.implementations` lists them).
            ``"triton"`` and ``"flex"`` run float64 inputs on ``"chunked"`` (same math).
        impl_options: options of the implementation named by ``impl`` (not ``"auto"``), e.g.
            ``{"precise": False}`` for ``"triton"`` (half-precision weights rounded once, as
            FlashAttention does) or ``{"block": 256}`` for ``"chunked"`` (query rows per
            block). An unknown name is a ``ValueError`` listing the valid ones.
        alibi_slopes: ALiBi (Press et al. 2022), as FlashAttention's: float ``(H_q,)`` or
            ``(B, H_q)``, adding ``-slope * |T_k - T_q + i - j|`` to the scores of query ``i``
            and key ``j`` after their scale (bottom-right aligned, as the causal mask). Only the
            softmax family (:data:`lssar.ops.ALIBI_VARIANTS`) takes it, on ``"reference"`` and
            ``"sdpa"`` (by query blocks, memory O(T_k * block)); elsewhere a ``ValueError``.
        cu_seqlens: packed documents, FlashAttention's layout: int32/int64 ``(n_docs + 1,)``
            cumulative lengths ``[0, len_0, len_0 + len_1, ..., T_q]`` along the time axis (the
            same packing for every batch row); a query sees only keys of its own document, and
            ``N_i`` (the length scale, LSSAR's threshold) counts within it. ``is_causal`` then
            applies per document (bottom-right aligned in each). Not with ``attn_mask``.
        cu_seqlens_k: the keys' boundaries when ``T_q != T_k`` (default: ``cu_seqlens``).
        window: sliding window ``(left, right)``: the query at key position ``t`` sees keys
            ``t - left .. t + right`` (``None``: unbounded; with ``is_causal``, ``(W - 1, 0)``
            is W keys ending at the query). ``N_i`` counts the keys inside the window.
        sink_tokens: with a window, the first ``sink_tokens`` keys of each document stay
            visible (attention sinks, as StreamingLLM).
        key_norms: ``1 / ||k_j||`` per key, float32 ``(B, H_kv, T_k)`` (a zero or non-finite key:
            0), as a KV cache keeps them (:meth:`lssar.model.KVCache.key_norms`) for the variants
            that normalise keys: computed once when a key enters the cache instead of at every
            decode step. A cache of a function of ``key``, not an input of the math: the ``cpu``
            decode entry reads them, every other path computes them from ``key`` (same
            result). Dropped where autocast changes ``key``'s dtype.
        **options: the variant's own keyword options (e.g. ``p`` for re-weighting).

    Returns:
        ``(B, H_q, T_q, D_v)`` in the input dtype. ``N_i`` is the number of keys row ``i`` may
        attend to; rows with ``N_i = 0`` (including ``T_k = 0``) are zero (never NaN), and masked
        keys, values and queries are never read (NaN padding cannot leak). Normalisation and
        statistics are computed in float32 for half-precision inputs.

    Under ``torch.autocast`` (for the inputs' device) this is a lower-precision op, as SDPA is:
    float16/bfloat16/float32 inputs are cast to autocast's dtype (float64 stays), and the
    implementation runs with autocast off, so its own half-precision rules hold (upcast,
    float32 statistics and GEMMs where it computes in float32); the output has autocast's dtype.
    """
    check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    check_alibi(alibi_slopes, query)
    _check_key_norms(key_norms, key, variant)
    spans = key_spans(
        query.shape[-2],
        key.shape[-2],
        query.device,
        is_causal,
        attn_mask,
        cu_seqlens,
        cu_seqlens_k,
        window,
        sink_tokens,
    )
    if spans is not None:
        is_causal = False  # folded into the spans
    device = query.device.type
    low = autocast_dtype(device)
    args = (attn_mask, dropout_p, is_causal, scale, enable_gqa, variant, impl, impl_options)
    if low is None:
        return _attention(query, key, value, *args, options, alibi_slopes, spans, key_norms)
    # one place for every implementation: left on, autocast would re-round the float32 score and
    # value GEMMs inside the materialised and chunked paths to bf16 (LSSAR p=15 errors 10-25x)
    if query.dtype != torch.float64:
        if key.dtype != low:
            key_norms = None  # the norms of the keys before rounding
        query, key, value = (t.to(low) for t in (query, key, value))
    with torch.autocast(device, enabled=False):
        return _attention(query, key, value, *args, options, alibi_slopes, spans, key_norms)


def _check_key_norms(key_norms: Tensor | None, key: Tensor, variant: str) -> None:
    """``key_norms`` of :func:`attention`: float32 ``(B, H_kv, T_k)`` beside ``key``, for a
    variant that normalises keys; ``ValueError`` saying what is wrong otherwise."""
    if key_norms is None:
        return
    if not get_variant(variant).qk_norm:
        raise ValueError(
            f"key_norms were given, but variant {variant!r} does not normalise its keys; pass "
            "them only for the QK-norm variants (lssa, lssar, softmax-qknorm-*)"
        )
    if not isinstance(key_norms, Tensor) or key_norms.dtype != torch.float32:
        raise ValueError(f"key_norms must be a float32 tensor, got {key_norms!r:.80}")
    if key_norms.shape != key.shape[:-1] or key_norms.device != key.device:
        raise ValueError(
            f"key_norms must have shape {tuple(key.shape[:-1])} (the key's B, H_kv, T_k) on "
            f"{key.device}, got {tuple(key_norms.shape)} on {key_norms.device}"
        )


def _attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    variant: str,
    impl: str,
    impl_options: dict[str, Any] | None,
    options: dict[str, Any],
    alibi_slopes: Tensor | None,
    spans: KeySpans | None = None,
    key_norms: Tensor | None = None,
) -> Tensor:
    """:func:`attention` after its checks, with autocast settled: route and run (``spans``:
    documents / window, the causal rule folded in)."""
    alibi = alibi_slopes is not None
    v, impl, opts, impl_opts = resolve(
        variant, impl, query, key, dropout_p, options, impl_options, alibi, spans is not None
    )
    attn_mask = as_4d(attn_mask)
    if attn_mask is not None and attn_mask.shape[-1] == 1 and key.shape[-2] > 1:
        attn_mask = attn_mask.expand(*attn_mask.shape[:-1], key.shape[-2])  # a view: no memory
    if is_causal and query.shape[-2] == 1 and spans is None:
        is_causal = False  # one bottom-right row (a decode step) sees every key: no mask to build
    if 0 in query.shape[:3] or key.shape[-2] == 0:
        # no output element (B, H_q or T_q = 0) or N_i = 0 everywhere (T_k = 0): zeros and zero
        # gradients, before any kernel divides by a size (H_q % H_kv: a SIGFPE in C++)
        empty = query[..., :0].sum() + key.sum() + value.sum()  # 0, keeps the graph
        return empty + query.new_zeros(query.shape[:-1] + value.shape[-1:])
    hides = BACKENDS[impl].hides
    # an impl that lets no masked entry into this call's result (a decode path) is spared the
    # pass over the whole cache that zeroes them
    if hides is None or not hides(query, key, value):
        if spans is None:
            query, key, value = hide_unseen(query, key, value, attn_mask, is_causal)
        else:
            query, key, value = hide_unseen_spans(query, key, value, attn_mask, spans)
    if scale is not None and v.scaling in ("log_n", "const"):
        raise ValueError(
            f"variant {v.name!r} uses the length scale ln(D) ln(N) and takes no `scale`; "
            "pass scale=None"
        )
    if "s" in opts and isinstance(opts["s"], Tensor) and opts["s"].dim() == 1:
        if opts["s"].shape[0] not in (1, query.shape[1]):
            raise ValueError(
                f"{v.name} `s` must have one entry per query head ({query.shape[1]}), "
                f"got shape {tuple(opts['s'].shape)}"
            )
    return BACKENDS[impl].fn(
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
        **impl_opts,
        # passed only when given: backends without ALiBi or spans keep their signature
        **({"alibi_slopes": alibi_slopes} if alibi else {}),
        **({"spans": spans} if spans is not None else {}),
        **({"key_norms": key_norms} if key_norms is not None and BACKENDS[impl].key_norms else {}),
    )
