"""A GPT with pluggable attention (nanoGPT-shaped, one file).

Token embedding, positions (``pos``: RoPE by default, ALiBi or none; no learned positions, no
length cap: it runs at any length; :mod:`lssar.positions`), pre-norm blocks of attention + MLP,
and a tied output head. Each block's attention is an :class:`lssar.nn.Attention` (the module
users put into their own models). The attention rule is chosen by name from ``lssar.variants()``
(``attn="softmax" | "lssa" | "lssar" | ...``, options such as ``p`` in ``attn_options``); the
model runs ``GPT.attn_spec``, an :class:`lssar.spec.AttentionSpec`, which may be switched after
training with :meth:`GPT.set_attention` (e.g. evaluate an LSSA-trained model with re-weighting
p=15: the paper's fine-tuning-free mode), and a RoPE model's rotation may be rescaled after
training (:meth:`GPT.set_rope_scaling`: PI, NTK, dynamic NTK, YaRN). :meth:`GPT.switch` is the
one eval-time rule of ``lssar eval``, ``lssar sample`` and ``lssar lm-eval``.

What a query sees is the causal rule plus, per call, a boolean ``attn_mask`` (padding), or the
structured arguments of :func:`lssar.attention`, O(T) to describe and O(T W) to run: a sliding
``window`` (each query's last W keys, with optional ``sink_tokens``) and packed documents
(``cu_seqlens``: each token attends only within its document, and ``N_i``, hence LSSA's length
scale, restarts at each; :func:`lssar.data.eot_documents` derives them from EOT tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lssar.nn import Attention, check_int, visibility
from lssar.ops import get_variant, key_inverse_norms
from lssar.positions import (
    ROPE_SCALINGS,
    RopeScaling,
    alibi_slopes,
    check_pos,
    check_rope,
    rope_cache,
)
from lssar.spec import AttentionSpec, check_attention


@dataclass
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # None = n_head; fewer = grouped-query attention
    n_embd: int = 128
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    rope_base: float = 10000.0
    pos: str = "rope"  # "rope" | "alibi" | "nope" (lssar.positions); runs before it: rope
    attn: str = "softmax"
    attn_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"p": 15.0}
    attn_impl: str = "auto"

    def __post_init__(self) -> None:
        # One check for every way a config arrives (train config, run checkpoint, HF config.json,
        # studies): a zero, negative, non-integer or non-finite size would otherwise surface as a
        # ZeroDivisionError, a torch shape error, or a model whose loss is NaN.
        for name in ("vocab_size", "n_layer", "n_head", "n_embd"):
            check_int(name, getattr(self, name))
        if self.n_kv_head is not None:
            check_int("n_kv_head", self.n_kv_head, "(or None: as many as n_head)")
        for name, ok, want in (
            ("mlp_ratio", lambda x: x > 0, "> 0, e.g. 4"),
            ("dropout", lambda x: 0 <= x < 1, "in [0, 1)"),
            ("rope_base", lambda x: x > 0, "> 0, e.g. 10000"),
        ):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise ValueError(f"{name}={x!r} must be a finite number {want}")
            if not ok(x):
                raise ValueError(f"{name}={x!r} must be {want}")
        if int(self.mlp_ratio * self.n_embd) < 1:
            raise ValueError(
                f"mlp_ratio={self.mlp_ratio} x n_embd={self.n_embd} leaves the MLP no hidden unit"
            )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError("head dim (n_embd / n_head) must be even for RoPE")
        if self.pos == "rope":
            check_rope(self.n_embd // self.n_head, self.rope_base)
        kv = self.n_kv_head or self.n_head
        if self.n_head % kv:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({kv})")
        check_attention(self.attn, self.attn_options, self.attn_impl)
        check_pos(self.pos, self.attn)

    @property
    def attention(self) -> AttentionSpec:
        """The attention the model is built with (its ``attn*`` fields as one spec)."""
        return AttentionSpec(self.attn, self.attn_options, self.attn_impl)


class KeyNorms:
    """``1 / ||k_j||`` (float32) of an append-only run of keys ``(B, H_kv, T, D)``, each computed
    once: the first time they are asked for after the key arrived (:meth:`extend`), into a
    buffer that doubles when full. What a KV cache passes as :func:`lssar.attention`'s
    ``key_norms``, so a decode step reads each cached key once and normalises none."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None
        self._n = 0

    def extend(self, keys: Tensor) -> Tensor:
        """The inverse norms ``(B, H_kv, T)`` of ``keys``, whose first keys are the ones seen by the
        previous call (a batch or device change starts over)."""
        b, h, t = keys.shape[:3]
        buf = self._buf
        if buf is None or buf.shape[:2] != (b, h) or buf.device != keys.device or t < self._n:
            buf, self._n = None, 0
        if buf is None or t > buf.shape[2]:
            grown = keys.new_empty(b, h, max(t, 2 * self._n), dtype=torch.float32)
            if buf is not None:
                grown[:, :, : self._n] = buf[:, :, : self._n]
            buf = self._buf = grown
        if self._n < t:
            buf[:, :, self._n : t] = key_inverse_norms(keys[:, :, self._n : t].detach())
            self._n = t
        return buf[:, :, :t]


class KVCache:
    """Per-layer keys/values of the tokens seen so far, ``(B, H_kv, T_seen, D)`` each.

    Held in buffers with room to grow (the capacity doubles when full), so a decode step writes
    its new keys and values in place instead of copying the whole cache (``torch.cat`` per step
    moved O(T) memory per token, more than the attention itself reads at long T): appending is
    amortised O(new tokens), and :meth:`update` returns views of the filled part (not contiguous
    across heads; every attention implementation takes strided inputs). Under autograd, where
    an in-place write would invalidate the views a backward pass saved, it concatenates.
    :meth:`key_norms` keeps the keys' inverse norms (:class:`KeyNorms`) for the QK-norm variants.
    """

    def __init__(self, n_layer: int) -> None:
        self._k: list[Tensor | None] = [None] * n_layer
        self._v: list[Tensor | None] = [None] * n_layer
        self._len = [0] * n_layer
        self._norms = [KeyNorms() for _ in range(n_layer)]

    def key_norms(self, layer: int) -> Tensor | None:
        """``1 / ||k_j||`` of the layer's cached keys, float32 ``(B, H_kv, T_seen)``, each computed
        once (:class:`KeyNorms`); None before the first update."""
        k = self._k[layer]
        return None if k is None else self._norms[layer].extend(k[:, :, : self._len[layer]])

    @property
    def length(self) -> int:
        return self._len[0]

    def past_length(self, layer: int) -> int:
        """Tokens cached for ``layer`` (what :class:`lssar.nn.Attention` counts positions from)."""
        return self._len[layer]

    @property
    def k(self) -> list[Tensor | None]:
        """Each layer's cached keys ``(B, H_kv, T_seen, D)`` (None before the first update)."""
        return [None if b is None else b[:, :, :n] for b, n in zip(self._k, self._len)]

    @property
    def v(self) -> list[Tensor | None]:
        """Each layer's cached values ``(B, H_kv, T_seen, D_v)``."""
        return [None if b is None else b[:, :, :n] for b, n in zip(self._v, self._len)]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k (B, H_kv, T, D)``, ``v (B, H_kv, T, D_v)``; return the layer's keys and
        values so far, ``(B, H_kv, T_seen, D)`` and ``(B, H_kv, T_seen, D_v)``."""
        n, t = self._len[layer], k.shape[2]
        old_k, old_v = self._k[layer], self._v[layer]
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            if old_k is not None:
                k = torch.cat([old_k[:, :, :n], k], dim=2)
                v = torch.cat([old_v[:, :, :n], v], dim=2)
            self._k[layer], self._v[layer], self._len[layer] = k, v, k.shape[2]
            return k, v
        if old_k is None or n + t > old_k.shape[2]:
            cap = max(n + t, 2 * n)
            new_k = k.new_empty(*k.shape[:2], cap, k.shape[3])
            new_v = v.new_empty(*v.shape[:2], cap, v.shape[3])
            if old_k is not None:
                new_k[:, :, :n] = old_k[:, :, :n]
                new_v[:, :, :n] = old_v[:, :, :n]
            self._k[layer], self._v[layer] = new_k, new_v
        self._k[layer][:, :, n : n + t] = k
        self._v[layer][:, :, n : n + t] = v
        self._len[layer] = n + t
        return self._k[layer][:, :, : n + t], self._v[layer][:, :, : n + t]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = Attention(
            cfg.n_embd,
            cfg.n_head,
            cfg.n_kv_head,
            variant=cfg.attn,
            options=cfg.attn_options,
            impl=cfg.attn_impl,
            pos=cfg.pos,
            rope_base=cfg.rope_base,
            dropout=cfg.dropout,
            layer_idx=layer_idx,
        )
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=False)
        hidden = int(cfg.mlp_ratio * cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, hidden, bias=False),
            nn.GELU(),
            nn.Linear(hidden, cfg.n_embd, bias=False),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, **attn: Any) -> Tensor:
        """``x (B, T, C)`` -> ``(B, T, C)``; ``attn``: :meth:`lssar.nn.Attention.forward`'s."""
        x = x + self.attn(self.ln1(x), attn_mask, **attn)
        return x + self.mlp(self.ln2(x))


def _check_row_starts(cu_seqlens: Tensor, b: int, t: int) -> None:
    """``ValueError`` unless every row start of a ``(B, T)`` batch is a document boundary."""
    if isinstance(cu_seqlens, Tensor) and b > 1:
        starts = torch.arange(0, b * t, t, device=cu_seqlens.device)
        if not bool(torch.isin(starts, cu_seqlens).all()):
            raise ValueError(
                f"cu_seqlens must hold every row start (0, {t}, {2 * t}, ...) of the flattened "
                f"({b}, {t}) batch: a document cannot span two rows"
            )


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx (B, T)) -> logits (B, T, V)`` (+ loss)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.rope_scaling: RopeScaling | None = None  # an eval-time rescaling of RoPE
        self.rope_train_len: int | None = None  # the length it rescales from
        self.set_attention(cfg.attention)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def set_attention(
        self, attn: AttentionSpec | str, options: dict[str, Any] | None = None, impl: str = "auto"
    ) -> None:
        """Run ``attn`` in every layer from now on, e.g. to evaluate with re-weighting.

        ``attn`` is a spec (``model.set_attention(model.attn_spec.override(p=15.0))`` keeps the
        trained impl where it can, see :meth:`AttentionSpec.override`), or a name with
        ``options`` and ``impl``.
        """
        if isinstance(attn, AttentionSpec):
            if options or impl != "auto":
                raise ValueError("pass options and impl inside the AttentionSpec, not beside it")
            spec = attn
        else:
            spec = AttentionSpec(attn, options or {}, impl)
        if "s" in get_variant(spec.name).options and spec.name != self.cfg.attn:
            raise ValueError(
                f"{spec.name} needs per-head scales learned in training; this model was trained "
                f"with {self.cfg.attn!r}, so it cannot switch to {spec.name}"
            )
        check_pos(self.cfg.pos, spec.name)  # an ALiBi model keeps a variant it can bias
        self.attn_spec = spec
        for block in self.blocks:
            block.attn.core.spec = spec

    def set_rope_scaling(self, scaling: RopeScaling | None, train_len: int | None = None) -> None:
        """Rescale the rotation of this RoPE model, trained at ``train_len`` tokens, from now on
        (``None``: the trained rotation). ``ValueError`` for a model without RoPE."""
        if scaling is not None:
            if self.cfg.pos != "rope":
                raise ValueError(
                    f"--rope-scaling ({', '.join(ROPE_SCALINGS)}) rescales RoPE; this model was "
                    f"trained with pos={self.cfg.pos!r} (no rotation), so it takes none"
                )
            if not isinstance(train_len, int) or train_len < 1:
                raise ValueError(f"a RoPE scaling needs the training length, got {train_len!r}")
            head_dim = self.cfg.n_embd // self.cfg.n_head
            check_rope(head_dim, self.cfg.rope_base, scaling, train_len)  # before any run
        self.rope_scaling = scaling
        self.rope_train_len = train_len if scaling is not None else None

    def switch(
        self,
        attn: str | None = None,
        attn_p: float | None = None,
        rope_scaling: str | None = None,
        rope_factor: Any = None,
        train_len: int | None = None,
    ) -> None:
        """The eval-time switch of ``lssar eval``, ``lssar sample`` and ``lssar lm-eval``, one
        rule for all three: the attention by :meth:`AttentionSpec.override` (``attn``,
        ``attn_p``), the RoPE scaling by :meth:`RopeScaling.from_flags` (``rope_scaling``,
        ``rope_factor``: a number or ``"auto"``, the default) from the training length
        ``train_len``. ``None`` keeps what the model runs."""
        scaling = RopeScaling.from_flags(rope_scaling, rope_factor)  # bad flags fail first
        self.set_attention(self.attn_spec.override(attn, p=attn_p))
        if scaling is not None:
            self.set_rope_scaling(scaling, train_len)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def body(
        self,
        h: Tensor,
        pos: int = 0,
        cache: KVCache | None = None,
        weights: list | None = None,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
        *,
        window: int | None = None,
        sink_tokens: int = 0,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """Run the blocks on embeddings ``h (B, T, C)`` at absolute positions ``pos..pos+T``.

        ``positions`` (``(T,)``, or ``(B|1, T)`` per row) overrides the RoPE positions (ALiBi
        and NoPE read none: ALiBi's bias is the distance in the sequence, padding included,
        which left padding leaves unchanged between real tokens);
        ``attn_mask`` (bool, broadcastable to ``(B, H, T, T_k)``, True = may attend) is combined
        with the causal mask in every layer. ``window`` (keys each query sees, itself included),
        ``sink_tokens`` and ``cu_seqlens`` (int ``(n_docs + 1,)`` document boundaries along T,
        the same for every row; not with a ``cache``) are :func:`lssar.attention`'s, in every
        layer.
        """
        if cu_seqlens is not None and cache is not None:
            raise ValueError(
                "cu_seqlens (packed documents) cannot be used with a KV cache: a cache continues "
                "one sequence, so call without cu_seqlens (one document)"
            )
        visibility(window, sink_tokens, cu_seqlens)  # bad values fail before any layer runs
        cos = sin = alibi = None
        if self.cfg.pos == "rope":
            if positions is None:
                positions = torch.arange(pos, pos + h.shape[1], device=h.device)
            head_dim = self.cfg.n_embd // self.cfg.n_head
            cos, sin = rope_cache(
                head_dim,
                positions.reshape(-1),
                self.cfg.rope_base,
                self.rope_scaling,
                self.rope_train_len,
            )
            if positions.dim() == 2:  # per row: (B|1, 1, T, D/2), broadcast over the heads
                cos = cos.view(positions.shape[0], 1, positions.shape[1], -1)
                sin = sin.view(positions.shape[0], 1, positions.shape[1], -1)
        elif self.cfg.pos == "alibi":  # the bias follows key/query order, not position ids
            alibi = alibi_slopes(self.cfg.n_head).to(h.device)
        h = self.drop(h)
        attn = {
            "cache": cache,
            "rope": None if cos is None else (cos, sin),
            "alibi_slopes": alibi,
            "window": window,
            "sink_tokens": sink_tokens,
            "cu_seqlens": cu_seqlens,
            "weights": weights,
        }
        for block in self.blocks:
            h = block(h, attn_mask, **attn)
        return self.ln_f(h)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        cache: KVCache | None = None,
        weights: list | None = None,
        reduction: str = "mean",
        attn_mask: Tensor | None = None,
        *,
        window: int | None = None,
        sink_tokens: int = 0,
        cu_seqlens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``idx (B, T)`` token ids -> ``(logits (B, T, V), loss or None)``.

        With a ``cache`` the tokens continue the cached sequence (positions start at its length).
        ``weights``, if a list, receives each layer's attention weights ``(B, H, T, T_k)``.
        ``reduction="none"`` returns the per-token loss ``(B, T)``. ``attn_mask`` (bool,
        broadcastable to ``(B, H, T, T_k)``, True = may attend, e.g. key padding) is combined
        with the causal mask in every layer.

        ``window``: every query sees only its last ``window`` keys, itself included (the
        sliding-window control; memory O(T W), no ``T x T`` mask), ``sink_tokens`` the first
        keys besides (StreamingLLM's sinks). ``cu_seqlens``: packed documents, int ``(n_docs +
        1,)`` boundaries along the batch flattened into one row of ``B * T`` tokens (as
        FlashAttention's varlen; every row start ``0, T, 2T, ...`` must be one, so a document
        never spans two rows; :func:`lssar.data.eot_documents` makes them): each token attends
        only within its document and ``N_i`` restarts there, so LSSA's length scale does too.
        RoPE positions stay each token's position in its row: RoPE and ALiBi see only the
        distance between a query and a key, so a document's logits equal those of the document
        alone (up to float rounding). Weights then come as ``(1, H, B T, B T)``. Not with a
        ``cache`` (:meth:`generate` runs one sequence) or an ``attn_mask``.
        """
        if idx.min() < 0 or idx.max() >= self.cfg.vocab_size:
            raise ValueError(
                f"token ids must be in [0, {self.cfg.vocab_size}); got "
                f"[{int(idx.min())}, {int(idx.max())}]"
            )
        pos = cache.length if cache is not None else 0
        spans = {"window": window, "sink_tokens": sink_tokens, "cu_seqlens": cu_seqlens}
        if cu_seqlens is None:
            h = self.body(self.wte(idx), pos, cache, weights, attn_mask, **spans)
        else:
            b, t = idx.shape
            _check_row_starts(cu_seqlens, b, t)
            rows = torch.arange(t, device=idx.device).repeat(b)  # (B T,) position in its row
            h = self.wte(idx).reshape(1, b * t, -1)  # (1, B T, C): one packed row
            h = self.body(h, pos, cache, weights, attn_mask, rows, **spans).view(b, t, -1)
        logits = self.head(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), reduction=reduction
            )
            if reduction == "none":
                loss = loss.view_as(targets)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Sample ``max_new_tokens`` after the prompt ``idx (B, T)`` with a KV cache.

        ``temperature`` 0 is greedy; ``top_k`` None samples from the whole vocabulary. Each row
        is one sequence (one document): an EOT token inside a prompt is attended across, with or
        without document masking in training (:meth:`forward` refuses ``cu_seqlens`` with a
        cache).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 0")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(
                f"temperature={temperature} must be a finite number >= 0 (0 = greedy, e.g. 0.8)"
            )
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
            raise ValueError(f"top_k={top_k!r} must be a whole number >= 1, or None")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1 (or None: no top-k)")
        cache = KVCache(self.cfg.n_layer)
        logits, _ = self(idx, cache=cache)
        out = [idx]
        for i in range(max_new_tokens):
            last = logits[:, -1, :].float()
            if temperature <= 0:
                nxt = last.argmax(-1, keepdim=True)
            else:
                # relative to the row's largest logit first: a tiny temperature (1e-45) then
                # gives -inf, not inf - inf = NaN, and softmax is unchanged
                last = (last - last.amax(-1, keepdim=True)) / temperature
                if top_k is not None:
                    kth = torch.topk(last, min(top_k, last.shape[-1])).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                nxt = torch.multinomial(last.softmax(-1), 1, generator=generator)
            out.append(nxt)
            if i + 1 < max_new_tokens:  # the last token's successor is never sampled
                logits, _ = self(nxt, cache=cache)
        return torch.cat(out, dim=1)
