"""Attention as ``torch.nn`` modules, for models of your own: drop-in layers over
:func:`lssar.attention`.

* :class:`Attention`: hidden states in, hidden states out, as ``fla.layers.Attention`` or
  flash-attention's ``MHA``: a fused q/k/v projection, grouped-query attention
  (``num_kv_heads``), RoPE, ALiBi or no positions (``pos``), an optional learned QK-norm, a
  sliding window and sink tokens, packed documents (``cu_seqlens``), a KV cache for decoding,
  and the output projection; any variant (``lssar.variants()``) on any implementation
  (``impl``).
* :class:`CoreAttention`: ``(q, k, v) -> o`` in the layout ``(B, H, T, D)`` for people who keep
  their own projections and positions.

Both are thin: the math is :func:`lssar.attention`'s, so a module's output equals the function
called with the same arguments. :class:`lssar.model.GPT` is built from :class:`Attention`.

Variants whose definition normalises q and k (lssa, lssar, softmax-qknorm-*) do it inside the
op; ``qk_norm=True`` adds a learned RMSNorm of q and k per head before the positions, as in
Qwen3 or OLMo2, for any variant. Variants that learn a per-head scale ``s`` (ssmax,
softmax-qknorm-learned) hold it as the parameter ``ssmax_s`` (``(num_heads,)``; the name
Scalable-Softmax gave it, kept so checkpoints keep their keys).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from lssar.ops import attention, attention_weights, get_variant, key_spans
from lssar.ops.common import as_4d
from lssar.positions import alibi_slopes as _alibi_slopes
from lssar.positions import apply_rope, check_pos, check_rope, rope_cache
from lssar.spec import AttentionSpec

__all__ = ["Attention", "CoreAttention", "scale_parameter", "visibility"]

SSMAX_S_INIT = 0.43  # Scalable-Softmax's per-head s at init (project choice)
_UNSET: Any = object()  # "the module's own setting" for a per-call argument


def check_int(name: str, value: Any, alternative: str = "") -> None:
    """``ValueError`` unless ``value`` is a whole number >= 1 (``alternative``: what else the
    setting takes, for the message)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = f" {alternative}" if alternative else ""
        raise ValueError(f"{name}={value!r} must be a whole number >= 1{hint}")


def visibility(
    window: int | None = None, sink_tokens: int = 0, cu_seqlens: Tensor | None = None
) -> dict[str, Any]:
    """The keyword arguments of :func:`lssar.attention` for a causal ``window`` of that many
    keys (itself included: ``window=(W - 1, 0)``), ``sink_tokens`` and ``cu_seqlens``; empty for
    none of them, so the default call is unchanged."""
    out: dict[str, Any] = {}
    if window is not None:
        check_int("window", window, "(the keys each query sees, itself included)")
        out["window"] = (window - 1, 0)
    if sink_tokens:
        out["sink_tokens"] = sink_tokens
    if cu_seqlens is not None:
        out["cu_seqlens"] = cu_seqlens
    return out


def scale_parameter(variant: str, num_heads: int | None) -> nn.Parameter | None:
    """The per-head scale ``s`` ``(num_heads,)`` at its initial value for a variant that learns
    one (ssmax, softmax-qknorm-learned); None for the others."""
    v = get_variant(variant)
    if "s" not in v.options:
        return None
    if num_heads is None:
        raise ValueError(f"{variant} learns one scale per head: pass num_heads")
    init = SSMAX_S_INIT if variant == "ssmax" else v.options.get("s")
    return nn.Parameter(torch.full((num_heads,), float(init)))


class CoreAttention(nn.Module):
    """``(query, key, value) -> output``, every tensor ``(B, H, T, D)`` (key and value with
    ``H_kv`` heads dividing ``H``: grouped-query attention), by :func:`lssar.attention`.

    ``variant``, ``options`` and ``impl`` are an :class:`lssar.spec.AttentionSpec` (held as
    ``spec``; assign another to switch, e.g. re-weighting at evaluation). ``causal``: each query
    sees the keys up to its own position, bottom-right aligned when ``T_q < T_k`` (a KV cache);
    ``window`` (keys each query sees, itself included) and ``sink_tokens`` (the first keys,
    seen besides) are the module's defaults, overridable per call. ``dropout`` applies to the
    attention weights in training. ``num_heads`` is needed by variants that learn a per-head
    scale (the parameter ``ssmax_s``); ``learned_scale=False`` leaves it to the caller
    (``s=`` in :meth:`forward`, as :class:`Attention` does).
    """

    def __init__(
        self,
        variant: str = "lssar",
        options: dict[str, Any] | None = None,
        impl: str = "auto",
        *,
        num_heads: int | None = None,
        causal: bool = True,
        window: int | None = None,
        sink_tokens: int = 0,
        dropout: float = 0.0,
        learned_scale: bool = True,
    ) -> None:
        super().__init__()
        self.spec = AttentionSpec(variant, options or {}, impl)
        if isinstance(dropout, bool) or not 0 <= dropout < 1:
            raise ValueError(f"dropout={dropout!r} must be a number in [0, 1)")
        visibility(window, sink_tokens)  # a bad window fails here
        self.causal, self.window, self.sink_tokens, self.dropout = (
            causal,
            window,
            sink_tokens,
            dropout,
        )
        self.ssmax_s = scale_parameter(variant, num_heads) if learned_scale else None

    def _options(self, s: Tensor | None) -> dict[str, Any]:
        """The spec's options with the learned scale for a variant that takes one."""
        options = self.spec.options
        if "s" in get_variant(self.spec.name).options:
            s = self.ssmax_s if s is None else s
            if s is None:
                raise ValueError(
                    f"{self.spec.name} needs its learned per-head scale: build the module with "
                    "num_heads, or pass s="
                )
            options = {**options, "s": s}
        return options

    def _visible(self, window: Any, sink_tokens: Any, cu_seqlens: Tensor | None) -> dict:
        return visibility(
            self.window if window is _UNSET else window,
            self.sink_tokens if sink_tokens is _UNSET else sink_tokens,
            cu_seqlens,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        *,
        alibi_slopes: Tensor | None = None,
        window: int | None = _UNSET,
        sink_tokens: int = _UNSET,
        cu_seqlens: Tensor | None = None,
        s: Tensor | None = None,
        key_norms: Tensor | None = None,
    ) -> Tensor:
        """``query (B, H, T_q, D)``, ``key (B, H_kv, T_k, D)``, ``value (B, H_kv, T_k, D_v)`` ->
        ``(B, H, T_q, D_v)``. ``attn_mask``: bool, broadcastable to ``(B, H, T_q, T_k)``, True =
        may attend (combined with the causal rule); ``alibi_slopes (H,)``: ALiBi's bias on the
        scores (softmax family); ``window`` / ``sink_tokens``: this call's, else the module's;
        ``cu_seqlens`` (int ``(n_docs + 1,)``): packed documents along T (B = 1), each attending
        within itself; ``s (H,)``: the learned scale, else the module's ``ssmax_s``;
        ``key_norms (B, H_kv, T_k)``: the keys' inverse norms, as a KV cache keeps them
        (:func:`lssar.attention`)."""
        return attention(
            query,
            key,
            value,
            attn_mask,
            self.dropout if self.training else 0.0,
            self.causal,
            None,
            query.shape[1] != key.shape[1],
            variant=self.spec.name,
            impl=self.spec.impl,
            alibi_slopes=alibi_slopes,
            key_norms=key_norms,
            **self._visible(window, sink_tokens, cu_seqlens),
            **self._options(s),
        )

    @torch.no_grad()
    def weights(
        self,
        query: Tensor,
        key: Tensor,
        attn_mask: Tensor | None = None,
        *,
        alibi_slopes: Tensor | None = None,
        window: int | None = _UNSET,
        sink_tokens: int = _UNSET,
        cu_seqlens: Tensor | None = None,
        s: Tensor | None = None,
    ) -> Tensor:
        """The attention weights ``(B, H, T_q, T_k)`` (float64-exact reference, materialised)
        that :meth:`forward` applies to the values, for diagnostics."""
        visible = self._visible(window, sink_tokens, cu_seqlens)
        spans, mask = None, attn_mask
        if visible:  # the causal rule folded in, as lssar.attention does
            mask = as_4d(attn_mask)
            t_q, t_k = query.shape[-2], key.shape[-2]
            spans = key_spans(t_q, t_k, query.device, self.causal, mask, **visible)
        return attention_weights(
            query,
            key,
            mask,
            self.causal and spans is None,
            None,
            query.shape[1] != key.shape[1],
            variant=get_variant(self.spec.name),
            options=self._options(s),
            alibi_slopes=alibi_slopes,
            spans=spans,
        )


class Attention(nn.Module):
    """Multi-head attention on hidden states: ``x (B, T, hidden_size) -> (B, T, hidden_size)``.

    ``num_heads`` query heads of ``hidden_size / num_heads`` dims and ``num_kv_heads`` key/value
    heads (dividing ``num_heads``; None: as many), projected by one ``qkv`` linear layer and
    brought back by ``proj``; ``bias`` on both. ``pos``: ``"rope"`` (base ``rope_base``, the
    half-split layout of GPT-NeoX / Llama), ``"alibi"`` (softmax family only) or ``"nope"``.
    ``qk_norm``: a learned RMSNorm of q and k per head. ``layer_idx``: this layer's slot in a KV
    cache. The attention itself is a :class:`CoreAttention` (``core``: ``variant``, ``options``,
    ``impl``, ``causal``, ``window``, ``sink_tokens``, ``dropout``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        variant: str = "lssar",
        options: dict[str, Any] | None = None,
        impl: str = "auto",
        pos: str = "rope",
        rope_base: float = 10000.0,
        causal: bool = True,
        window: int | None = None,
        sink_tokens: int = 0,
        dropout: float = 0.0,
        qk_norm: bool = False,
        bias: bool = False,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size)
        check_int("num_heads", num_heads)
        kv = num_heads if num_kv_heads is None else num_kv_heads
        check_int("num_kv_heads", kv, "(or None: as many as num_heads)")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads")
        if num_heads % kv:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({kv})")
        check_pos(pos, variant)
        self.n_head, self.n_kv, self.head_dim = num_heads, kv, hidden_size // num_heads
        if pos == "rope" and self.head_dim % 2:
            raise ValueError("the head dim (hidden_size / num_heads) must be even for RoPE")
        if pos == "rope":
            check_rope(self.head_dim, rope_base)
        self.pos, self.rope_base, self.layer_idx = pos, float(rope_base), layer_idx
        # (the order of these two layers is the order their weights draw from the RNG)
        self.qkv = nn.Linear(hidden_size, (num_heads + 2 * kv) * self.head_dim, bias=bias)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.core = CoreAttention(
            variant,
            options,
            impl,
            causal=causal,
            window=window,
            sink_tokens=sink_tokens,
            dropout=dropout,
            learned_scale=False,
        )
        self.ssmax_s = scale_parameter(variant, num_heads)
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else None

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        cache: Any = None,
        rope: tuple[Tensor, Tensor] | None = None,
        alibi_slopes: Tensor | None = None,
        window: int | None = _UNSET,
        sink_tokens: int = _UNSET,
        cu_seqlens: Tensor | None = None,
        weights: list | None = None,
    ) -> Tensor:
        """``x (B, T, C)`` -> ``(B, T, C)``.

        ``attn_mask``: bool, broadcastable to ``(B, H, T, T_k)`` (e.g. key padding), combined
        with the causal rule. ``positions`` (``(T,)`` or ``(B|1, T)``): RoPE positions, default
        ``past .. past + T`` with ``past`` the tokens already in ``cache`` for this layer.
        ``cache``: anything with ``update(layer, k, v) -> (k, v)`` (all keys and values so far)
        and ``past_length(layer)``, e.g. :class:`lssar.model.KVCache`; one with
        ``key_norms(layer)`` hands the QK-norm variants its keys' inverse norms, computed once
        per key instead of at every step. ``rope``: precomputed
        ``(cos, sin)`` (``(T, D/2)`` or ``(B|1, 1, T, D/2)``; a model computes them once for
        all layers, with a RoPE scaling), ``alibi_slopes (H,)`` likewise. ``window``,
        ``sink_tokens``, ``cu_seqlens``: as :meth:`CoreAttention.forward` (packed documents
        along T with B = 1; not with a cache). ``weights``: if a list, this layer's attention
        weights ``(B, H, T, T_k)`` are appended.
        """
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim],
            dim=-1,
        )
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.pos == "rope":
            cos, sin = rope if rope is not None else self._rope(t, positions, cache, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif self.pos == "alibi" and alibi_slopes is None:
            alibi_slopes = _alibi_slopes(self.n_head).to(x.device)
        key_norms = None
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
            if get_variant(self.core.spec.name).qk_norm and hasattr(cache, "key_norms"):
                key_norms = cache.key_norms(self.layer_idx)  # each key normalised once
        span = {"window": window, "sink_tokens": sink_tokens, "cu_seqlens": cu_seqlens}
        y = self.core(
            q,
            k,
            v,
            attn_mask,
            alibi_slopes=alibi_slopes,
            s=self.ssmax_s,
            key_norms=key_norms,
            **span,
        )
        if weights is not None:
            weights.append(
                self.core.weights(
                    q, k, attn_mask, alibi_slopes=alibi_slopes, s=self.ssmax_s, **span
                )
            )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def _rope(
        self, t: int, positions: Tensor | None, cache: Any, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """cos, sin for this call's positions (given, else after the cached tokens)."""
        if positions is None:
            past = 0 if cache is None else int(cache.past_length(self.layer_idx))
            positions = torch.arange(past, past + t, device=device)
        cos, sin = rope_cache(self.head_dim, positions.reshape(-1), self.rope_base)
        if positions.dim() == 2:  # per row: (B|1, 1, T, D/2), broadcast over the heads
            cos = cos.view(positions.shape[0], 1, positions.shape[1], -1)
            sin = sin.view(positions.shape[0], 1, positions.shape[1], -1)
        return cos, sin
