"""Structured visibility: packed documents (``cu_seqlens``), sliding windows and sink tokens.

Each of these rules lets query row ``i`` see one contiguous range of keys ``[lo_i, hi_i)``, plus,
with sink tokens, a second one ``[sink_lo_i, sink_hi_i)`` (the first keys of its document), so a
:class:`KeySpans` holds four ``(T_q,)`` vectors instead of a ``T_q x T_k`` mask. From them come
``N_i`` in O(T) (:func:`span_counts`; LSSA's length scale and LSSAR's threshold ``1 / N_i`` count
only the keys a row may see, so a packed row restarts both at each document), the keys a block of
rows needs (:meth:`KeySpans.key_index`: the fused implementations skip every other key, O(T W)
work for a window W) and, only for a block, the boolean mask (:meth:`KeySpans.visible`).

Meaning (FlashAttention's varlen and ``window_size``, with ``None`` where it writes ``-1``):

- ``cu_seqlens (n_docs + 1,)``: document ``d`` holds query rows ``cu_seqlens[d] ..
  cu_seqlens[d+1] - 1`` and, without ``cu_seqlens_k``, the same keys; ``cu_seqlens_k`` gives the
  keys' boundaries when ``T_q != T_k`` (a document's new queries against its cache). Every batch
  row is packed the same way (transformers' flattening collator packs into one row).
- positions are bottom-right aligned within each document, as the causal rule: the ``t``-th of a
  document's ``n_q`` queries over its ``n_k`` keys sits at key position ``n_k - n_q + t``;
- ``window=(left, right)``: that query sees the keys from ``left`` before its position to
  ``right`` after it (``None``: unbounded; a side longer than the sequence, ``sys.maxsize`` or
  ``2**64`` included, reaches every key: the full sequence);
- ``sink_tokens=S``: the first ``S`` keys of each document stay visible to every query that is
  allowed to see them by the causal rule (StreamingLLM's attention sinks); ``S`` larger than a
  document is the whole document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lssar.ops.common import zero_unseen

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class KeySpans:
    """The keys each query row may see: ``[lo, hi)`` and ``[sink_lo, sink_hi)`` (None without
    sink tokens), int64 ``(rows,)``, with ``lo <= hi`` and ``sink_lo <= sink_hi <= lo``; ``pos``:
    each row's position on the key axis (ALiBi's distances); ``t_k``: the number of keys."""

    lo: Tensor
    hi: Tensor
    sink_lo: Tensor | None
    sink_hi: Tensor | None
    pos: Tensor
    t_k: int

    def rows(self, i0: int, i1: int) -> KeySpans:
        """The spans of rows ``i0:i1``."""
        s = slice(i0, i1)
        sinks = self.sink_lo is not None
        return KeySpans(
            self.lo[s],
            self.hi[s],
            self.sink_lo[s] if sinks else None,
            self.sink_hi[s] if sinks else None,
            self.pos[s],
            self.t_k,
        )

    def lengths(self) -> Tensor:
        """``N_i`` without a mask: float32 ``(rows,)``."""
        n = self.hi - self.lo
        if self.sink_lo is not None:
            n = n + (self.sink_hi - self.sink_lo)
        return n.to(torch.float32)

    def key_index(self) -> slice | Tensor | None:
        """The keys some row of these spans may see: a ``slice`` (one range), an int64 index
        (sinks apart from the window), or None (no key). Reads the bounds on the host."""
        lo, hi = self.lo, self.hi
        if self.sink_lo is not None:
            live = self.sink_hi > self.sink_lo
            if bool(live.any()):
                s0, s1 = int(self.sink_lo[live].min()), int(self.sink_hi[live].max())
                live_w = hi > lo
                if not bool(live_w.any()):
                    return slice(s0, s1)
                k0, k1 = int(lo[live_w].min()), int(hi[live_w].max())
                if s1 >= k0 and s0 <= k1:  # overlapping or touching: one range
                    return slice(min(s0, k0), max(s1, k1))
                first, second = sorted(((s0, s1), (k0, k1)))
                return torch.cat([torch.arange(*first), torch.arange(*second)]).to(lo.device)
        live = hi > lo
        if not bool(live.any()):
            return None
        return slice(int(lo[live].min()), int(hi[live].max()))

    def visible(self, keys: slice | Tensor) -> Tensor:
        """Boolean ``(rows, len(keys))``: row ``i`` may see key ``keys[j]``."""
        if isinstance(keys, slice):
            j = torch.arange(keys.start, keys.stop, device=self.lo.device)
        else:
            j = keys
        ok = (j >= self.lo[:, None]) & (j < self.hi[:, None])
        if self.sink_lo is not None:
            ok = ok | ((j >= self.sink_lo[:, None]) & (j < self.sink_hi[:, None]))
        return ok

    def dense(self) -> Tensor:
        """The whole ``(T_q, T_k)`` mask (the materialised implementations)."""
        return self.visible(slice(0, self.t_k))

    def seen_keys(self) -> Tensor:
        """Boolean ``(T_k,)``: keys some row may see (a difference array: O(T))."""
        cover = torch.zeros(self.t_k + 1, dtype=torch.int64, device=self.lo.device)
        for lo, hi in ((self.lo, self.hi), (self.sink_lo, self.sink_hi)):
            if lo is None:
                continue
            one = (hi > lo).to(torch.int64)
            cover.index_add_(0, lo, one)
            cover.index_add_(0, hi, -one)
        return cover.cumsum(0)[:-1] > 0


def _check_cu(name: str, cu: Any, total: int, device: torch.device) -> Tensor:
    if not isinstance(cu, Tensor) or cu.dtype not in _INT_DTYPES or cu.dim() != 1:
        got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, Tensor) else type(cu)
        raise ValueError(
            f"{name} must be a 1-D int32/int64 tensor of document boundaries "
            f"[0, len_0, len_0 + len_1, ..., T] (FlashAttention's layout), got {got}"
        )
    if cu.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds no values: the document boundaries are "
            "read on the host; pass them as a CPU tensor (or on the queries' device)"
        )
    if cu.device not in (device, torch.device("cpu")):
        # a GPU tensor beside CPU queries (or another GPU's) was moved silently: refused, as
        # any other argument on the wrong device
        raise ValueError(
            f"{name} is on {cu.device} but the queries are on {device}; pass it on the "
            "queries' device or the CPU"
        )
    if cu.numel() < 2:
        raise ValueError(f"{name} needs at least 2 entries ([0, T] for one document), got {cu}")
    host = cu.detach().to("cpu", torch.int64)
    if int(host[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(host[0])}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (cumulative lengths), got {host.tolist()}")
    if int(host[-1]) != total:
        raise ValueError(
            f"{name} must end at the sequence length {total} (the packed tokens), got "
            f"{int(host[-1])}"
        )
    return host.to(device)


def _check_window(window: Any, reach: int) -> tuple[int | None, int | None]:
    """``window``'s sides checked, each capped at ``reach`` (a distance no query and key of
    the call are apart): a wider side means "all of it", and a Python int of any size then
    fits int64 (``sys.maxsize`` used to wrap around, ``2**64`` to overflow)."""
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    ok = ok and all(w is None or (isinstance(w, int) and not isinstance(w, bool)) for w in window)
    if not ok:
        raise ValueError(
            f"window must be a pair (left, right) of ints >= 0 or None (unbounded), got "
            f"{window!r}; e.g. window=(127, 0) with is_causal=True: 128 keys ending at the query"
        )
    if any(w is not None and w < 0 for w in window):
        raise ValueError(
            f"window sides must be >= 0 or None (unbounded; FlashAttention writes -1), got "
            f"{tuple(window)}"
        )
    return tuple(None if w is None else min(w, reach) for w in window)


def key_spans(
    t_q: int,
    t_k: int,
    device: torch.device,
    is_causal: bool,
    attn_mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    sink_tokens: int = 0,
) -> KeySpans | None:
    """The :class:`KeySpans` of a call, the causal rule folded in; None when the call has neither
    documents nor a window (the plain causal / mask path). ``ValueError`` naming the argument for
    bad input (see the module docstring for the meaning)."""
    if isinstance(sink_tokens, bool) or not (isinstance(sink_tokens, int) and sink_tokens >= 0):
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    if cu_seqlens_k is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_k needs cu_seqlens (the queries' document boundaries)")
    if cu_seqlens is None and window is None:
        if sink_tokens:
            raise ValueError(
                "sink_tokens keeps the first keys visible beside a sliding window; pass "
                "window=(left, right) with it (without a window every key is visible already)"
            )
        return None
    i = torch.arange(t_q, device=device)
    if cu_seqlens is None:
        ks = torch.zeros_like(i)
        ke = torch.full_like(i, t_k)
        pos = i + (t_k - t_q)
    else:
        if attn_mask is not None:
            raise ValueError(
                "attn_mask with cu_seqlens is ambiguous (is the mask over packed positions or "
                "per document?): packed documents carry no padding; pass one of them"
            )
        cu_q = _check_cu("cu_seqlens", cu_seqlens, t_q, device)
        if cu_seqlens_k is None:
            if t_q != t_k:
                raise ValueError(
                    f"T_q = {t_q} != T_k = {t_k}: pass cu_seqlens_k, the keys' document "
                    "boundaries, beside cu_seqlens"
                )
            cu_k = cu_q
        else:
            cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, t_k, device)
            if cu_k.numel() != cu_q.numel():
                raise ValueError(
                    f"cu_seqlens and cu_seqlens_k must describe the same documents, got "
                    f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
                )
        doc = torch.searchsorted(cu_q[1:], i, right=True)  # each row's document
        qs, qe, ks, ke = cu_q[doc], cu_q[doc + 1], cu_k[doc], cu_k[doc + 1]
        pos = ke - (qe - qs) + (i - qs)
    lo, hi = ks, torch.minimum(ke, pos + 1) if is_causal else ke
    if window is not None:
        # positions lie in [-t_q, t_k): no two of them are t_q + t_k apart
        left, right = _check_window(window, t_q + t_k)
        if left is not None:
            lo = torch.maximum(ks, pos - left)
        if right is not None:
            hi = torch.minimum(hi, pos + right + 1)
    hi = torch.maximum(hi, lo)
    sink_lo = sink_hi = None
    if sink_tokens:
        if window is None or window[0] is None:
            raise ValueError(
                "sink_tokens needs a window with a bounded left side, e.g. window=(127, 0); "
                "without one every earlier key is visible already"
            )
        sink_lo = ks
        sinks = min(sink_tokens, t_k)  # more sinks than keys: every key (and no int64 overflow)
        sink_hi = torch.maximum(torch.minimum(torch.minimum(ks + sinks, lo), hi), ks)
    return KeySpans(lo, hi, sink_lo, sink_hi, pos, t_k)


def block_visibility(spans: KeySpans, mask: Tensor | None, i0: int, i1: int):
    """Rows ``i0:i1``: the keys they may see (:meth:`KeySpans.key_index`; None: none) and their
    visibility ``(B|1, H|1, rows, keys)`` with the caller's 4-dim ``mask`` (or None) folded in."""
    sub = spans.rows(i0, i1)
    keys = sub.key_index()
    if keys is None:
        return None, None
    m = sub.visible(keys)[None, None]
    if mask is not None:
        mb = mask[..., i0:i1, :] if mask.shape[-2] > 1 else mask
        m = m & (mb[..., keys] if mb.shape[-1] > 1 else mb)
    return keys, m


def add_at_keys(dst: Tensor, keys: slice | Tensor, x: Tensor) -> None:
    """``dst[:, :, keys] += x`` in place, for a :meth:`KeySpans.key_index` (a slice or an index
    of distinct keys): how the blocked paths add a block's key gradients."""
    if isinstance(keys, slice):
        dst[:, :, keys] += x
    else:
        dst.index_add_(2, keys, x)


def span_counts(spans: KeySpans, attn_mask: Tensor | None) -> Tensor:
    """``N_i``: float32 ``(B|1, H|1, T_q, 1)``, the keys each row's spans hold that ``attn_mask``
    (4-dim or None; never with documents) also allows. O(T) without a mask or with key padding."""
    if attn_mask is None:
        return spans.lengths().reshape(1, 1, -1, 1)
    t_k = spans.t_k
    if attn_mask.shape[-2] == 1:  # key padding: prefix sums over the keys
        keys = attn_mask[..., 0, :].expand(*attn_mask.shape[:-2], t_k)
        cs = torch.nn.functional.pad(keys.cumsum(-1, dtype=torch.float32), (1, 0))
        n = cs.index_select(-1, spans.hi) - cs.index_select(-1, spans.lo)
        if spans.sink_lo is not None:
            n = n + cs.index_select(-1, spans.sink_hi) - cs.index_select(-1, spans.sink_lo)
        return n.unsqueeze(-1)
    full = attn_mask.expand(*attn_mask.shape[:-1], t_k) & spans.dense()
    return full.sum(-1, keepdim=True, dtype=torch.float32)


def hide_unseen_spans(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, spans: KeySpans
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`lssar.ops.common.hide_unseen` for spans: zero the keys and values no row may see
    and the queries that see none, so NaN padding there cannot reach a result."""
    seen_k = spans.seen_keys().reshape(1, 1, -1, 1)
    n = span_counts(spans, attn_mask)
    if attn_mask is not None:
        m = attn_mask.expand(*attn_mask.shape[:-1], spans.t_k)
        if m.shape[-2] == 1:
            seen_k = seen_k & m.transpose(-1, -2)
        else:
            seen_k = (m & spans.dense()).any(-2, keepdim=True).transpose(-1, -2)
    return zero_unseen(query, key, value, n > 0, seen_k)
