"""Memory-efficient exact LSSA / LSSAR (and any softplus-l1 variant) for CPU and GPU.

Queries are processed in blocks of ``block`` rows. A block's full score rows
``(B, H, block, T_k)`` are formed once, so the two passes of docs/method.md section 4 (row
statistics ``Z_i, mu_i, max_j x_ij``, then the weights) happen in-register over that slab; nothing
of size ``T_q x T_k`` ever exists. The backward recomputes each block's weights and applies the
closed-form gradients of docs/method.md section 5 (``dx``, the ``F_i`` row term, ``sigmoid`` for
Softplus), so the memory of forward + backward is ``O(T * block)``. Causal blocks stop at their
last visible key.

The op is registered as ``lssar::softplus_attention`` (``torch.library.custom_op`` with a fake
implementation and a registered autograd formula), so ``torch.compile`` traces through it.

``fused=True`` (``impl="cpu"``) runs the same op's float32 CPU calls on the fused C++ kernel
(``cpu/softplus_attention.cpp``, built by :mod:`lssar.ops.cpu.build`): the same blocks and the
same arithmetic in two passes over each cache-resident row instead of a dozen eager passes over
the slab. Whatever it does not take (float64, CUDA, rows whose every weight underflows, a machine
that cannot build it) runs on the eager path below.

A decode step (a few queries, no gradient) goes to :mod:`lssar.ops.decode`; the blocked forward
and backward here and that decode share one weight rule (:mod:`lssar.ops.weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lssar.ops.common import (
    REWEIGHT_MIN_KEYS,
    as_4d,
    causal_mask,
    count_visible,
    expand_kv,
    uniform_tolerance,
    unit,
    visible_counts,
)
from lssar.ops.cpu.unit import unit_cpu
from lssar.ops.decode import decode_applies, decode_step, is_decode_step
from lssar.ops.spans import KeySpans, add_at_keys, block_visibility
from lssar.ops.weights import row_scale
from lssar.ops.weights import softplus_weights as _weights  # a module global: tests spy on it

DEFAULT_BLOCK_ELEMS = 1 << 22  # score elements per block: 16 MB fp32 slabs, a few live at once
# Fused backward: score elements per block of query rows (per thread, each of its 3-4 slabs 2 MB
# in fp32). Every block adds a rank-R update to all of dk and dv, so taller blocks mean less
# traffic; measured on 2 cores, fwd+bwd at T = 16K: 1.62x (lssa) / 1.76x (lssar) SDPA with
# 512 KB slabs, 1.26x / 1.30x with 2 MB.
FUSED_BLOCK_ELEMS = 1 << 19
# ... but causal blocks of 32 rows: a block computes its rows' scores up to its last row's key, so
# tall blocks compute the triangle above the diagonal they never use (a 256-row block at T = 256:
# twice the work). Measured (1 thread, fp32, backward alone): B=32 H=4 D=32 T = 256 lssa 40 ->
# 26 ms, lssar 44 -> 31 ms; T = 1K (B=4 H=8 D=64) 189 -> 153 ms / 204 -> 164 ms; T = 4K about
# 4% / 10% less. Non-causal rows see every key, and taller blocks stay better there.
FUSED_CAUSAL_ROWS = 32
# Fused forward: tiles of 512 keys (their packed K and V stay in L2 while a block's rows use
# them). LSSA: blocks of 256 query rows (one pass, tiles add up), the blocking of PyTorch's own CPU
# flash kernel. LSSAR: blocks of 64 rows whose softplus values are kept between its two passes
# (written once, read once; recomputing them per tile cost more than the traffic it saves).
LSSA_ROWS, LSSA_KEY_TILE, LSSAR_ROWS = 256, 512, 64
# bf16 q and k with the QK-norm: the fused forward computes Q K^T from the bf16 inputs on
# AVX512-BF16 dot products where the build and the CPU have them (the kernel's bf16_dot; exact
# products, float32 sums, the norms applied after), else from their normalised float32 copies.
# False: always the float32 copies (comparisons).
BF16_DOT = True


def _block_rows(bh: int, t_k: int, block: int) -> int:
    if block > 0:
        return block
    return max(16, min(1024, DEFAULT_BLOCK_ELEMS // max(1, bh * t_k)))


def _fused_rows(t_k: int, block: int, is_causal: bool) -> int:
    if block > 0:
        return block
    rows = max(16, min(256, FUSED_BLOCK_ELEMS // max(1, t_k)))
    return min(rows, FUSED_CAUSAL_ROWS) if is_causal else rows


def _fused_call(
    name: str, tensors, q: Tensor, k: Tensor, mask, is_causal, scale, log_n, p, block, raw=None
):
    """Run the C++ kernel's ``name`` on float32 CPU tensors; None where the eager path must run
    (not float32 on CPU, kernel unavailable, or a row whose every softplus underflowed: relative
    weights needed). ``raw``: the bf16 query and key before their QK-norm (see :data:`BF16_DOT`),
    or None."""
    if tensors[0].dtype != torch.float32 or q.device.type != "cpu":
        return None
    from lssar.ops.cpu.build import kernel

    mod = kernel()
    if mod is None:
        return None
    B, H, t_q, _ = q.shape
    t_k = k.shape[2]
    views = [_kernel_view(t.detach()) for t in tensors]
    m4 = None if mask is None else as_4d(mask).expand(B, H, t_q, t_k)
    rule = (-1.0 if p is None else p, float(REWEIGHT_MIN_KEYS), uniform_tolerance(torch.float32))
    if name == "forward":
        tiling = (block if block > 0 else LSSA_ROWS if p is None else LSSAR_ROWS, LSSA_KEY_TILE)
    else:
        tiling = (_fused_rows(t_k, block, is_causal),)
    run = getattr(mod, name)
    raws = (None, None) if raw is None else [_kernel_view(t.detach()) for t in raw]
    *outs, status = run(*views, m4, H, is_causal, scale, log_n, *rule, *tiling, *raws)
    if status == 2:  # a bf16 input not finite: Q K^T from the normalised float32 copies
        *outs, status = run(*views, m4, H, is_causal, scale, log_n, *rule, *tiling, None, None)
    return None if status else outs


def _kernel_view(t: Tensor) -> Tensor:
    """``t (B, H, T, D)`` as the kernel reads it in place (rows of unit stride that lie apart, any
    batch and head strides: a transposed view of a model's projections), else a contiguous copy."""
    b, h, n, d = t.shape
    rows = d <= 1 or t.stride(3) == 1
    apart = n <= 1 or d <= t.stride(2) < 2**31
    return t if rows and apart else t.contiguous()


def _block_rows_mask(mask: Tensor | None, i0: int, i1: int, k_end: int) -> Tensor | None:
    """The caller's mask for rows ``i0:i1`` and keys ``0:k_end``; a size-1 axis is kept whole."""
    if mask is None:
        return None
    mb = mask[..., i0:i1, :] if mask.shape[-2] > 1 else mask
    return mb[..., :k_end] if mb.shape[-1] > 1 else mb


def _block_mask(
    mb: Tensor | None,
    is_causal: bool,
    i0: int,
    i1: int,
    k_end: int,
    offset: int,
    device: torch.device,
) -> Tensor | None:
    """Visibility of rows ``i0:i1`` over keys ``0:k_end`` (broadcastable to the score slab),
    from the caller's mask for those rows (:func:`_block_rows_mask`) and the causal rule."""
    m = None
    if is_causal and offset + i0 < k_end - 1:  # some key in range is in the future of some row
        m = causal_mask(i1 - i0, k_end, device, q_start=offset + i0)
    if mb is not None:
        m = mb if m is None else (mb & m)
    return m


def _blocks(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    block: int,
    dtype: torch.dtype,
    spans: KeySpans | None = None,
):
    """Query blocks with work to do: ``(i0, i1, keys, m, n, c)`` = rows ``i0:i1`` over the keys
    ``keys`` (a slice, or an index with sink tokens), their visibility ``m`` (None = all
    visible), counts ``N_i`` and row scales. With ``spans`` (documents, a window) a block reads
    only the keys its rows may see."""
    B, H, t_q, _ = q.shape
    t_k = k.shape[2]
    mask = as_4d(mask)
    offset = t_k - t_q
    rows = _block_rows(B * H, t_k, block)
    for i0 in range(0, t_q, rows):
        i1 = min(t_q, i0 + rows)
        if spans is not None:
            keys, m = block_visibility(spans, mask, i0, i1)
            if keys is None:  # no row of the block sees a key: output stays 0
                continue
            n = count_visible(m, 0).to(dtype)
            yield i0, i1, keys, m, n, row_scale(n, scale, log_n)
            continue
        k_end = min(t_k, max(0, offset + i1)) if is_causal else t_k
        if k_end == 0:  # rows before the first key (T_q > T_k, causal): output stays 0
            continue
        mb = _block_rows_mask(mask, i0, i1, k_end)
        m = _block_mask(mb, is_causal, i0, i1, k_end, offset, q.device)
        n = visible_counts(mb, is_causal, i1 - i0, k_end, q.device, q_start=offset + i0)
        n = n.to(dtype)
        yield i0, i1, slice(0, k_end), m, n, row_scale(n, scale, log_n)


def _spans_of(lo: Tensor | None, hi, sink_lo, sink_hi, t_k: int) -> KeySpans | None:
    """The custom op's span tensors back as :class:`KeySpans` (None without them)."""
    if lo is None:
        return None
    return KeySpans(lo, hi, sink_lo, sink_hi, hi, t_k)  # pos: unused here


def _fused_blocks(name, tensors, mask, scale, log_n, p, block, spans):
    """The fused kernel by blocks of rows over only the keys they may see (documents, a
    window): ``[out]`` (forward of ``q, k, v``) or ``[dq, dk, dv]`` (backward of ``grad, q, k,
    v``); None where the eager path must run."""
    q, k, v = tensors[-3:]
    B, H, t_q, _ = q.shape
    mask = as_4d(mask)
    forward = name == "forward"
    outs = (
        [q.new_zeros(q.shape[:-1] + v.shape[-1:])]
        if forward
        else [torch.zeros_like(t) for t in (q, k, v)]
    )
    rows = block if block > 0 else LSSA_ROWS
    for i0 in range(0, t_q, rows):
        i1 = min(t_q, i0 + rows)
        keys, m = block_visibility(spans, mask, i0, i1)
        if keys is None:
            continue
        qb, kb, vb = q[:, :, i0:i1], k[:, :, keys], v[:, :, keys]
        args = (qb, kb, vb) if forward else (tensors[0][:, :, i0:i1], qb, kb, vb)
        got = _fused_call(name, args, qb, kb, m, False, scale, log_n, p, 0)
        if got is None:
            return None
        outs[0][:, :, i0:i1] = got[0].reshape(outs[0][:, :, i0:i1].shape)
        if not forward:
            add_at_keys(outs[1], keys, got[1].reshape(kb.shape))
            add_at_keys(outs[2], keys, got[2].reshape(vb.shape))
    return outs


@torch.library.custom_op("lssar::softplus_attention", mutates_args=())
def softplus_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    p: float | None,
    block: int,
    fused: bool = False,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    sink_lo: Tensor | None = None,
    sink_hi: Tensor | None = None,
    q_raw: Tensor | None = None,
    k_raw: Tensor | None = None,
) -> Tensor:
    """Forward of softplus-l1 attention (+ optional re-weighting). ``q (B,H,T_q,D)``,
    ``k (B,H,T_k,D)``, ``v (B,H,T_k,D_v)`` -> ``(B,H,T_q,D_v)`` in ``q``'s dtype. ``lo .. sink_hi``:
    a :class:`KeySpans`' vectors (documents, a window), or None. ``q_raw, k_raw``: bf16 ``q`` and
    ``k`` before the QK-norm that gave these (fused only; see :data:`BF16_DOT`), or None."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    spans = _spans_of(lo, hi, sink_lo, sink_hi, k.shape[2])
    if fused:
        if spans is None:
            args = (mask, is_causal, scale, log_n, p, block)
            raw = None if q_raw is None or k_raw is None else (q_raw, k_raw)
            got = _fused_call("forward", (qf, kf, vf), q, k, *args, raw=raw)
        else:
            got = _fused_blocks("forward", (qf, kf, vf), mask, scale, log_n, p, block, spans)
        if got is not None:
            return got[0].reshape(q.shape[:-1] + v.shape[-1:]).to(v.dtype)
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=dtype, device=q.device)
    for i0, i1, keys, m, n, c in _blocks(q, k, mask, is_causal, scale, log_n, block, dtype, spans):
        _, num, den, _ = _weights(qf[:, :, i0:i1], c, kf[:, :, keys], m, n, p)
        out[:, :, i0:i1] = (num @ vf[:, :, keys]) / den
    return out.to(v.dtype)  # q, k may arrive upcast (normalised in float32); v has the input's


@softplus_attention_op.register_fake
def _softplus_attention_fake(
    q, k, v, mask, is_causal, scale, log_n, p, block, fused=False, *spans_and_raw
):
    return v.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("lssar::softplus_attention_backward", mutates_args=())
def softplus_attention_backward_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    p: float | None,
    block: int,
    fused: bool = False,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    sink_lo: Tensor | None = None,
    sink_hi: Tensor | None = None,
    q_raw: Tensor | None = None,
    k_raw: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recomputing backward: ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``; ``q_raw,
    k_raw`` as the forward's."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    g = grad.to(dtype)
    spans = _spans_of(lo, hi, sink_lo, sink_hi, k.shape[2])
    if fused:
        tensors = (g, qf, kf, vf)
        if spans is None:
            raw = None if q_raw is None or k_raw is None else (q_raw, k_raw)
            args = (mask, is_causal, scale, log_n, p, block)
            got = _fused_call("backward", tensors, q, k, *args, raw=raw)
        else:
            got = _fused_blocks("backward", tensors, mask, scale, log_n, p, block, spans)
        if got is not None:
            return tuple(d.reshape(t.shape).to(t.dtype) for d, t in zip(got, (q, k, v)))
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for i0, i1, keys, m, n, c in _blocks(q, k, mask, is_causal, scale, log_n, block, dtype, spans):
        qb, kb, vb, gb = qf[:, :, i0:i1], kf[:, :, keys], vf[:, :, keys], g[:, :, i0:i1]
        s, num, den, stats = _weights(qb, c, kb, m, n, p, want_pm1=True)
        g_den = gb / den  # P^T g = num^T (g / den)
        dp = g_den @ vb.transpose(-1, -2)  # dP / den  (B, H, rows, T_k)
        if p is not None:
            # dP - D = (dP - dP_top) - sum_j P_j (dP_j - dP_top) with top the row's largest
            # weight: the same (sum_j P_j = 1), but a nearly one-hot row (p = 15, few keys) no
            # longer cancels dP_top against D ~ dP_top. That rounding, amplified by p / x_max
            # and spread over the row by F_i / N_i, reached every key's gradient; the
            # reference's autograd cancels it through x_max (dq errors were up to 25x its own
            # at T = 4, now as the reference's)
            has = stats[2]  # rows that fall back to LSSA (not has) stay as LSSA's
            dp = dp - torch.where(has, dp.gather(-1, num.argmax(-1, keepdim=True)), 0.0)
        # D_i = sum_j P_ij dP_ij from the same slab (not g_i.out_i): exact cancellation for
        # one-key rows (dP_top - D = 0)
        centred = dp - (num * dp).sum(-1, keepdim=True) / den  # (dP - D) / den
        shift = stats[0]
        if p is None:
            da = centred  # (dP - D) / Z
        else:
            _, big, has, x_max, r_pm1 = stats
            # dx = p P (dP - D) / x = p r^(p-1) (dP - D) / (sum_w x_max): no division by x
            dx = r_pm1 * centred * (p / x_max)
            f = dx.sum(-1, keepdim=True)
            da = dx - torch.where(big, f / n.clamp_min(1.0), torch.zeros_like(f))
            if not bool(has.all()):
                da = torch.where(has, da, centred)
        # d softplus / ds, relative like the weights on rows that underflowed (shift != 0)
        ds = da * (torch.sigmoid(s) if shift is None else torch.exp(F.logsigmoid(s) - shift))
        if m is not None:
            ds = torch.where(m, ds, 0.0)
        ds = ds * c  # d/d(q.k): the row scale applied to the slab, as to the scores
        add_at_keys(dv, keys, num.transpose(-1, -2) @ g_den)
        dq[:, :, i0:i1] = ds @ kb
        add_at_keys(dk, keys, ds.transpose(-1, -2) @ qb)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@softplus_attention_backward_op.register_fake
def _softplus_attention_backward_fake(
    grad, q, k, v, mask, is_causal, scale, log_n, p, block, fused=False, *spans_and_raw
):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, log_n, p, block, fused, *spans_and_raw = inputs
    ctx.save_for_backward(q, k, v, mask, *spans_and_raw)
    ctx.args = (is_causal, scale, log_n, p, block, fused)


def _backward(ctx, grad):
    q, k, v, mask, *spans_and_raw = ctx.saved_tensors
    dq, dk, dv = softplus_attention_backward_op(grad, q, k, v, mask, *ctx.args, *spans_and_raw)
    return dq, dk, dv, *(None,) * (7 + len(spans_and_raw))  # options, spans, raw q and k


softplus_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "impl='chunked' and impl='cpu' have no double backward (their backward is a closed-form "
        "kernel); for second-order gradients call lssar.attention(..., impl='reference')"
    )


softplus_attention_backward_op.register_autograd(
    _no_double_backward, setup_context=lambda ctx, inputs, output: None
)


def _softplus_attention(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    variant,
    options,
    block: int,
    fused: bool,
    spans: KeySpans | None = None,
    key_norms: Tensor | None = None,
) -> Tensor:
    if dropout_p > 0:
        raise ValueError("impl='chunked' has no dropout; use impl='reference' for dropout_p > 0")
    c, log_n = variant.softplus_scale(query.shape[-1], scale, options)
    p = options.get("p")
    if decode_applies(query, key, value) if fused else is_decode_step(query, key, value):
        p = None if p is None else float(p)
        args = (attn_mask, is_causal, float(c), log_n, variant.qk_norm, p, spans, fused)
        return decode_step(query, key, value, *args, key_norms)
    if enable_gqa:
        key, value = expand_kv(query, key, value)
    raw = ()
    if variant.qk_norm:  # in float32 for half inputs, robust at every scale
        bf16 = query.dtype == key.dtype == torch.bfloat16 and query.device.type == "cpu"
        if fused and bf16 and spans is None and BF16_DOT:
            raw = (None,) * 4 + (query.detach(), key.detach())  # no spans, then q_raw, k_raw
        norm = unit_cpu if fused else unit
        query, key = norm(query), norm(key)
    return softplus_attention_op(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        float(c),
        log_n,
        None if p is None else float(p),
        int(block),
        bool(fused),
        *(raw if spans is None else (spans.lo, spans.hi, spans.sink_lo, spans.sink_hi)),
    )


def chunked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant,
    options,
    block: int = 0,
    spans: KeySpans | None = None,
) -> Tensor:
    """Memory-efficient softplus-l1 attention (lssa, lssar, softplus-l1 with any ``p``).

    Same contract as :func:`lssar.ops.reference.reference_attention`; ``block`` = query rows per
    block (0 = choose from the sequence length). Returns ``(B, H_q, T_q, D_v)``.
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _softplus_attention(*args, variant, options, block, False, spans)


def cpu_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant,
    options,
    block: int = 0,
    spans: KeySpans | None = None,
    key_norms: Tensor | None = None,
) -> Tensor:
    """``impl="cpu"``: :func:`chunked_attention` on the fused C++ kernel (float32 statistics;
    ``block`` = query rows per block, 0 = sized so a block's scores stay in L2; ``key_norms``: the
    keys' inverse norms a KV cache keeps, read by the decode entry)."""
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _softplus_attention(*args, variant, options, block, True, spans, key_norms)
