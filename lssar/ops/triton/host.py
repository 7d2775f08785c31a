"""Host code of ``impl="triton"``: N_i and norms, launches, custom ops, the public function.

The kernels are :mod:`lssar.ops.triton.kernels`, their autotuning :mod:`lssar.ops.triton.autotune`.
Conventions (shared with every implementation, see :mod:`lssar.ops.common`): layout
``[B, H, T, D]``; GQA with head ``h`` reading kv head
``h // (H_q / H_kv)``; bottom-right causal alignment (query ``t`` sits at absolute position
``T_k - T_q + t``); boolean ``attn_mask`` broadcastable to ``[B, H_q, T_q, T_k]``, combinable with
``is_causal``; ``N_i`` = visible keys (:func:`lssar.ops.common.visible_counts`, a
``[B, H_q, T_q]`` vector computed in torch before the launch). Head dims up to 256 (any value:
tiles are padded to a power of two); ``D_v`` may differ from ``D``.

Key spans (:class:`lssar.ops.spans.KeySpans`: packed documents, sliding windows, sink tokens;
the causal rule folded in): ``N_i`` from :func:`lssar.ops.spans.span_counts`, each row's bounds
as int32 planes ``[lo; hi(; sink_lo; sink_hi)]`` ``(2|4, T_q)`` (``HAS_SPANS``, ``HAS_SINKS``),
and for the dk/dv kernel per key the query rows that may see it, int32 ``(2, T_k)``
(:func:`_key_rows`); the kernels visit only the blocks these reach.

Inputs ``q, k`` of the length-scaled variants are L2-normalised *inside* the kernels: the raw
``q . k`` dot (fp32 accumulation) is scaled by fp32 inverse norms
(:func:`lssar.ops.common.inv_norm`), which is as accurate as normalising in fp32 and keeps the
kernels' inputs in the model's dtype. The op's gradients are taken through the normalisation in
fp32 (``dq = dq_fix - q_hat (q_hat . dq_fix)``).

Precision: for half inputs the fp32 weights / score gradients must enter the tensor cores in the
input dtype: by default (``precise=True``) each goes in as a ``hi + lo`` pair (two MMAs, error
~2^-16 instead of 2^-9 for bf16), which keeps outputs and gradients as accurate as the
fp32-computed reference; ``precise=False`` rounds once, as FlashAttention does (1 MMA, ~2x the
reference's error). ``precise`` is this implementation's option:
``lssar.attention(..., impl="triton", impl_options={"precise": False})``.

TF32: fp32 inputs multiply in IEEE fp32 (FMA units, no tensor cores: the fp32 accuracy rule of
the tests holds) unless ``torch.backends.cuda.matmul.allow_tf32`` is True at the call (False by
default in torch; ``torch.set_float32_matmul_precision("high")`` sets it): then the host launches
the kernels with ``IEEE=False`` (a constexpr), so every ``tl.dot`` on fp32 tiles takes Triton's
default input precision, ``"tf32"`` (tensor cores, 10-bit mantissa inputs, fp32 accumulation).
**TF32 changes the numerics**: errors near bf16's rather than fp32's; the fp32 accuracy rule
(2x / 3x the reference's fp32 error) does not apply to it. The forward and the backward each read
the flag when they launch. If ``TRITON_F32_DEFAULT`` sets another default than ``"tf32"``, the
flag is ignored and fp32 stays IEEE (:func:`_tf32`).

Limits: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (slow; for tests). ``float64``
inputs run on :func:`lssar.ops.chunked.chunked_attention` (``lssar.attention`` routes them there;
same math, exact in float64). No dropout. Block sizes are autotuned per (head dim, flags, length
bucket) on the GPU; under the interpreter a fixed 16 x 16 tile is used. ``TRITON_INTERPRET=1``
must be set before ``triton`` is first imported. Two Triton 3.9 interpreter defects are worked
around only when interpreting: bf16 ``tl.dot`` (wrong: operands are upcast) and fp32 -> bf16
stores (truncated: torch rounds the output instead).

One module (~640 lines): the custom ops, their fakes and autograd, the launches they make and the
public function share the private helpers (:class:`_Launch`, the span planes, the norms); a
split would export those helpers only to import them back.
"""

from typing import Any

import torch
import triton
from torch import Tensor

from lssar.ops.common import NORM_EPS, as_4d, inv_norm, uniform_tolerance, visible_counts
from lssar.ops.spans import KeySpans, span_counts
from lssar.ops.triton import autotune as A
from lssar.ops.triton import decode as DEC
from lssar.ops.triton import kernels as K
from lssar.ops.variants import Variant

MAX_HEAD_DIM = 256
INTERPRET_BLOCK = 16  # tl.dot needs tiles of at least 16
INTERPRET_SMS = 8  # the SMs a decode step is split for when interpreted (tests see several slices)
DECODE_MAX_QUERIES = 16  # a call with at most this many queries and no gradient is a decode step
# the dk/dv formulation launched when interpreted (the GPU's autotuner picks it per config:
# lssar.ops.triton.autotune); tests set it to run the sm_90 wgmma formulations
INTERPRET_DKDV = {"KEY_MAJOR": False, "ONE_GRAD": False}
UNIFORM_TOL = uniform_tolerance(torch.float32)  # statistics are fp32 for every input dtype
# the kernels were decorated for the interpreter (a module constant: torch.compile reads it)
_INTERPRETED = K.INTERPRETED


def _interpreting() -> bool:
    """Whether the kernels were decorated for the interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETED


def _launch(kernel, tuned, rows: int, parallel: int, *args: Any, **kwargs: Any) -> None:
    """Launch ``ceil(rows / block) * parallel`` programs on a 1-D grid (axis 0 takes 2^31 - 1
    programs, axis 1 only 65,535: large batch x heads would not launch); the kernels split the
    program id back into (block, batch*head). The block is ``BM`` (row kernels), ``BN`` (dk/dv)
    or one (decode: ``rows`` slices). The dk/dv kernel's ``ONE_GRAD`` configs take two
    programs per key block (one for dk, one for dv). Fixed 16x16 tiles when interpreted (dk/dv
    with :data:`INTERPRET_DKDV`'s formulation)."""
    dkdv = kernel is K.bwd_dkdv_kernel
    block = "BN" if dkdv else None if kernel is DEC.decode_kernel else "BM"
    if _interpreting():
        meta = {"BM": INTERPRET_BLOCK, "BN": INTERPRET_BLOCK, **(INTERPRET_DKDV if dkdv else {})}
        meta = {k: v for k, v in meta.items() if k in kernel.arg_names and k not in kwargs}
        size = 1 if block is None else INTERPRET_BLOCK
        grid = (triton.cdiv(rows, size) * parallel * _programs_per_block(meta),)
        kernel[grid](*args, **meta, **kwargs)
        return
    tuned[
        lambda meta: (
            triton.cdiv(rows, 1 if block is None else meta[block])
            * parallel
            * _programs_per_block(meta),
        )
    ](*args, **kwargs)


def _programs_per_block(meta: dict) -> int:
    """Programs per tile of a launch: 2 for dk/dv's ``ONE_GRAD`` configs, else 1."""
    return 2 if meta.get("ONE_GRAD", False) else 1


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _len_key(t: int) -> int:
    """Autotuning bucket for a sequence length (re-tuning per decode step would be ruinous)."""
    return min(triton.next_power_of_2(max(t, 1)), 1 << 14)


def _p_int(p: float | None) -> int:
    """``p`` as a compile-time integer when it is one in [1, 127], else 0 (exp2/log2 path)."""
    if p is not None and p == int(p) and 1 <= p <= 127:
        return int(p)
    return 0


def _tf32(dtype: torch.dtype) -> bool:
    """Whether fp32 inputs may multiply on TF32 tensor cores: fp32, torch's
    ``torch.backends.cuda.matmul.allow_tf32``, and Triton's default ``tl.dot`` precision for
    fp32 is ``"tf32"`` (what ``IEEE=False`` then selects; ``TRITON_F32_DEFAULT`` can change it)."""
    from triton import knobs

    default = knobs.language.fp32_default
    return (
        dtype == torch.float32
        and bool(torch.backends.cuda.matmul.allow_tf32)
        and default in (None, "tf32")
    )


def _poly(dtype: torch.dtype, precise: bool) -> int:
    """Degree of the kernels' log2(1 + u) polynomial (relative error in fp32): 8 for fp32 inputs
    (1.5e-7, a few ulp), 6 for half-precision inputs with ``precise`` (1.4e-6, below the
    ``hi + lo`` split's 2^-16), 5 without (8.5e-6: weights are rounded to 2^-9 / 2^-11 for the
    products; even raised to p = 15 near a row's maximum the error stays below that rounding)."""
    if dtype == torch.float32:
        return 8
    return 6 if precise else 5


def _unit_scale(x: Tensor) -> Tensor:
    # by a power of two near the largest entry: exact in every dtype, so no rounding is added
    big = x.detach().abs().amax(-1, keepdim=True).to(torch.float32)
    ok = (big > 0) & torch.isfinite(big)
    pow2 = torch.exp2(torch.floor(torch.log2(torch.where(ok, big, 1.0))))
    return (x.to(torch.float32) / pow2).to(x.dtype)


def _unnormalise_grad(x: Tensor, g_fix: Tensor) -> Tensor:
    """Gradient through ``x_hat = x / max(||x||, eps)`` from the fixed-norm gradient ``g_fix``.

    ``g_fix = dL/dx`` with the norm held constant (what the kernels produce); the norm's own
    dependence removes the radial part: ``dx = g_fix - x_hat (x_hat . g_fix)`` (unless clamped).
    """
    xf = x.to(torch.float32)
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    x_hat = xf / norm.clamp_min(NORM_EPS)
    radial = (x_hat * g_fix).sum(-1, keepdim=True) * (norm > NORM_EPS)
    return torch.where(norm > 0, g_fix - x_hat * radial, 0.0)  # a zero vector: zero gradient


def _spans(lo, hi, sink_lo, sink_hi, t_k: int) -> KeySpans | None:
    """The custom op's span vectors back as :class:`KeySpans` (None without them)."""
    if lo is None:
        return None
    return KeySpans(lo, hi, sink_lo, sink_hi, hi, t_k)  # pos (ALiBi's distances): unused here


def _span_planes(spans: KeySpans) -> Tensor:
    """The rows' bounds for the kernels: int32 ``(2, T_q)`` ``[lo; hi]``, or ``(4, T_q)`` with
    ``[sink_lo; sink_hi]`` below."""
    rows = [spans.lo, spans.hi]
    if spans.sink_lo is not None:
        rows += [spans.sink_lo, spans.sink_hi]
    return torch.stack(rows).to(torch.int32).contiguous()


def _rows_seeing(lo: Tensor, hi: Tensor, t_k: int) -> tuple[Tensor, Tensor]:
    """Per key ``j``, rows ``[first_j, last_j)`` containing every row ``i`` with
    ``lo_i <= j < hi_i`` (int64 ``(T_k,)`` each). No monotonicity is assumed: ``first_j`` is the
    first row whose running maximum of ``hi`` passes ``j``, ``last_j`` one past the last row
    whose ``lo`` is ``<= j`` (a suffix minimum). For bounds non-decreasing in ``i`` (documents,
    windows and the causal rule give such, for ``T_q != T_k`` too) the range is exactly the rows
    that see ``j``; otherwise a superset (more work, the same result: the kernel masks)."""
    j = torch.arange(t_k, device=lo.device, dtype=lo.dtype)
    first = torch.searchsorted(hi.cummax(0).values, j, right=True)
    suffix_min = lo.flip(0).cummin(0).values.flip(0)
    last = torch.searchsorted(suffix_min, j, right=True)
    return first, last


def _key_rows(spans: KeySpans, t_q: int) -> Tensor:
    """For the dk/dv kernel: int32 ``(2, T_k)`` ``[first; last]``, the query rows that may see
    each key (window or sinks; their hull when both, contiguous for documents + window + sinks);
    ``first >= last`` when none. The kernel takes the hull over its key block."""
    first, last = _rows_seeing(spans.lo, spans.hi, spans.t_k)
    if spans.sink_lo is not None:
        s_first, s_last = _rows_seeing(spans.sink_lo, spans.sink_hi, spans.t_k)
        on, s_on = last > first, s_last > s_first
        first = torch.minimum(torch.where(on, first, t_q), torch.where(s_on, s_first, t_q))
        last = torch.maximum(torch.where(on, last, 0), torch.where(s_on, s_last, 0))
    return torch.stack([first, last]).to(torch.int32).contiguous()


class _Launch:
    """Everything the four kernels share: pointers' strides, sizes, flags."""

    def __init__(self, q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, stats, spans):
        B, H, t_q, d = q.shape
        hk, t_k, dv = k.shape[1], k.shape[2], v.shape[-1]
        self.B, self.H, self.HK, self.t_q, self.t_k = B, H, hk, t_q, t_k
        self.q, self.k, self.v = q, k, v
        self.stats = stats
        self.iq = inv_norm(q) if qk_norm else stats
        self.ik = inv_norm(k) if qk_norm else stats
        m4 = as_4d(mask)
        if m4 is None:
            self.m, self.mstrides = stats, (0, 0, 0, 0)
        else:
            # bool -> uint8 view keeps the broadcast (zero) strides: no copy of the mask
            self.m = m4.expand(B, H, t_q, t_k).view(torch.uint8)
            self.mstrides = self.m.stride()
        # spans: each row's key bounds (int32 planes); without them a placeholder pointer
        self.sp = stats if spans is None else _span_planes(spans)
        self.p = 1.0 if p is None else p
        self.scale = scale
        self.plane = B * H * t_q
        self.keys = (_len_key(t_q), _len_key(t_k))
        self.meta = dict(
            D=d,
            DV=dv,
            BD=_pow2(d),
            BDV=_pow2(dv),
            CAUSAL=bool(is_causal),
            HAS_MASK=m4 is not None,
            LOG_N=bool(log_n),
            QK_NORM=bool(qk_norm),
            REWEIGHT=p is not None,
            P_INT=_p_int(p),
            IEEE=q.dtype == torch.float32 and not _tf32(q.dtype),  # False: TF32 (see above)
            UPCAST=_interpreting() and q.dtype == torch.bfloat16,
            SPLIT=bool(precise) and q.dtype in (torch.float16, torch.bfloat16),
            HAS_SPANS=spans is not None,
            HAS_SINKS=spans is not None and spans.sink_lo is not None,
            POLY=_poly(q.dtype, precise),
        )

    def sizes(self) -> tuple:
        """``H, G, T_q, T_k, off, plane`` (the kernels' leading scalars)."""
        return (self.H, self.H // self.HK, self.t_q, self.t_k, self.t_k - self.t_q, self.plane)

    def kw(self, kernel, **extra: Any) -> dict[str, Any]:
        """The constexprs ``kernel`` takes, from :attr:`meta` and ``extra``."""
        names = set(kernel.arg_names)
        return {k: v for k, v in {**self.meta, **extra}.items() if k in names}

    def strides(self, *ts: Tensor) -> tuple[int, ...]:
        return tuple(s for t in ts for s in t.stride()[:3])


def _contiguous_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(
    q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, spans=None, for_backward=True
):
    """``(out, stats, aux)``: the output, the rows' ``(N, mu, x_max, W)`` (fp32
    ``(4, B, H, T_q)``) and, for LSSAR with ``for_backward``, ``p / (W x_max) (U - S out)`` and
    the fp32 output per row (``(B, H, T_q, 2, BDV)``, :func:`lssar.ops.triton.kernels.fwd_kernel`),
    which the backward turns into ``F_i`` and an exact ``D_i`` with no pass over the keys (empty
    otherwise: an inference forward skips the extra product and accumulator)."""
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    B, H, t_q, _ = q.shape
    t_k = k.shape[2]
    # the Triton 3.9 interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): let torch
    # round the interpreter's bf16 outputs
    buf_dtype = torch.float32 if _interpreting() and q.dtype == torch.bfloat16 else q.dtype
    out = torch.zeros(B, H, t_q, v.shape[-1], dtype=buf_dtype, device=q.device)
    stats = torch.zeros(4, B, H, t_q, dtype=torch.float32, device=q.device)  # N, mu, x_max, W
    fold = p is not None and for_backward
    aux = torch.zeros(_aux_shape(q, v, p, fold), dtype=torch.float32, device=q.device)
    if t_q == 0 or t_k == 0 or B * H == 0:
        return out, stats, aux
    if spans is None:
        n = visible_counts(mask, is_causal, t_q, t_k, q.device)  # (B|1, H|1, T_q|1, 1)
    else:
        n = span_counts(spans, as_4d(mask))  # (B|1, H|1, T_q, 1)
    stats[0] = n.squeeze(-1).expand(B, H, t_q)
    L = _Launch(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, stats, spans)
    _launch(
        K.fwd_kernel,
        A.fwd_tuned,
        t_q,
        B * H,
        q, k, v, out, stats, aux, L.iq, L.ik, L.m, L.sp,
        *L.strides(q, k, v, out), *L.mstrides,
        *L.sizes(), L.scale, L.p, UNIFORM_TOL, *L.keys,
        **L.kw(K.fwd_kernel, FOLD_F=fold),
    )  # fmt: skip
    return out.to(q.dtype), stats, aux


def _aux_shape(q: Tensor, v: Tensor, p: float | None, fold: bool) -> tuple[int, ...]:
    """Shape of the forward's ``aux`` output: LSSAR's per-row vectors, or empty."""
    return (*q.shape[:3], 2, _pow2(v.shape[-1])) if p is not None and fold else (0,)


def _deterministic(deterministic: bool) -> bool:
    """The backward's dq: deterministic (its own kernel) if asked for or if torch's
    ``torch.use_deterministic_algorithms(True)`` is in force; else fused into dk/dv (atomics),
    for half-precision inputs (:func:`_backward`)."""
    return bool(deterministic) or torch.are_deterministic_algorithms_enabled()


def _backward(
    grad, q, k, v, out, mask, stats, aux, is_causal, scale, log_n, qk_norm, p, precise,
    deterministic=False, spans=None,
):  # fmt: skip
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    grad, out = _contiguous_last(grad), _contiguous_last(out)
    B, H, t_q, d = q.shape
    hk, t_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    if t_q == 0 or t_k == 0 or B * H == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if p is not None and aux.numel() == 0:
        raise RuntimeError(
            "the LSSAR backward needs the forward's F_i vectors: run the forward with "
            "for_backward=True (triton_attention does when an input requires grad)"
        )
    L = _Launch(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, stats, spans)
    key_rows = stats if spans is None else _key_rows(spans, t_q)  # dk/dv: rows seeing each key
    bd, bdv = L.meta["BD"], L.meta["BDV"]
    dev = q.device
    rc = torch.empty(K.RC_PLANES, B, H, t_q, dtype=torch.float32, device=dev)  # row coefficients
    # fp32 inputs keep the dq kernel: the fused dq spilled in their FMA-unit dk/dv tiles
    fused = not _deterministic(deterministic) and q.dtype in (torch.float16, torch.bfloat16)
    dq = (torch.zeros if fused else torch.empty)(B, H, t_q, bd, dtype=torch.float32, device=dev)
    dk = torch.empty(B, hk, t_k, bd, dtype=torch.float32, device=dev)
    dvv = torch.empty(B, hk, t_k, bdv, dtype=torch.float32, device=dev)
    _launch(
        K.bwd_rows_kernel,
        A.rows_tuned,
        t_q,
        B * H,
        out, grad, stats, aux, rc, L.iq,
        *L.strides(out, grad),
        H, t_q, L.plane, L.scale, L.p,
        **L.kw(K.bwd_rows_kernel),
    )  # fmt: skip
    sizes = (*L.sizes(), L.p, *L.keys)
    if not fused:
        _launch(
            K.bwd_dq_kernel,
            A.dq_tuned,
            t_q,
            B * H,
            q, k, v, grad, rc, L.ik, L.m, L.sp, dq,
            *L.strides(q, k, v, grad), *L.mstrides,
            *sizes,
            **L.kw(K.bwd_dq_kernel),
        )  # fmt: skip
    _launch(
        K.bwd_dkdv_kernel,
        A.dkdv_tuned,
        t_k,
        B * hk,
        q, k, v, grad, rc, L.ik, L.m, L.sp, key_rows, dk, dvv, dq,
        *L.strides(q, k, v, grad), *L.mstrides,
        *sizes,
        **L.kw(K.bwd_dkdv_kernel, FUSED_DQ=fused),
    )  # fmt: skip
    dq, dk, dvv = dq[..., :d], dk[..., :d], dvv[..., :dv]
    if qk_norm:
        dq, dk = _unnormalise_grad(q, dq), _unnormalise_grad(k, dk)
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (:data:`INTERPRET_SMS` when interpreted or
    recorded on CPU tensors by the compile check)."""
    if _interpreting() or device.type != "cuda":
        return INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise) -> Tensor:
    """A decode step on :mod:`lssar.ops.triton.decode`'s split-K kernels (forward only):
    ``(B, H, T_q, D_v)`` in ``q``'s dtype. The host adds the slices' partial sums."""
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    B, H, t_q, _ = q.shape
    hk, t_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    g, dev = H // hk, q.device
    stats = torch.zeros(4, B, H, t_q, dtype=torch.float32, device=dev)  # N (the rest unused)
    stats[0] = visible_counts(mask, is_causal, t_q, t_k, dev).squeeze(-1).expand(B, H, t_q)
    L = _Launch(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, stats, None)
    bm, bdv = DEC.rows_per_program(g, t_q), L.meta["BDV"]
    align = INTERPRET_BLOCK if _interpreting() else DEC.MAX_BN
    nsplit, span = DEC.splits(B * hk, t_k, _sm_count(dev), align)
    f32 = dict(dtype=torch.float32, device=dev)
    part = torch.empty(nsplit, B * hk, bm, bdv, **f32)  # sum_j w_ij v_j per slice
    prow = torch.empty(3, nsplit, B * hk, bm, **f32)  # Z_i, max_j t_ij, W_i per slice
    scores = torch.empty(B * hk, g * t_q, t_k, **f32) if p is not None else stats  # LSSAR's t_ij
    for step in (1, 2) if p is not None else (2,):
        _launch(
            DEC.decode_kernel,
            DEC.decode_tuned,
            nsplit,
            B * hk,
            q, k, v, stats, L.iq, L.ik, L.m, scores, part, prow,
            *L.strides(q, k, v), *L.mstrides,
            *L.sizes(), L.scale, L.p, UNIFORM_TOL, nsplit, span, B * hk,
            **L.kw(DEC.decode_kernel, PASS=step, BM=bm),
        )  # fmt: skip
    w = prow[2].sum(0)  # (B * hk, bm)
    out = part.sum(0) / torch.where(w > 0, w, 1.0).unsqueeze(-1)
    out = out[:, : g * t_q, :dv].reshape(B, hk, g, t_q, dv).reshape(B, H, t_q, dv)
    return out.to(q.dtype)


@torch.library.custom_op("lssar::triton_softplus_decode", mutates_args=())
def triton_softplus_decode_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    qk_norm: bool,
    p: float | None,
    precise: bool,
) -> Tensor:
    """A decode step, forward only (no autograd): the arguments as
    :func:`triton_softplus_attention_op`'s; ``out (B,H_q,T_q,D_v)`` in ``q``'s dtype."""
    return _decode(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise)


@triton_softplus_decode_op.register_fake
def _triton_decode_fake(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise):
    return q.new_empty(*q.shape[:3], v.shape[-1])


def _decode_step(
    query: Tensor, key: Tensor, value: Tensor, spans: KeySpans | None, grad: bool
) -> bool:
    """Whether a call runs on the decode kernels: at most :data:`DECODE_MAX_QUERIES` queries,
    their GQA group's rows fit one tile (:func:`lssar.ops.triton.decode.applies`), and no
    gradient to record (``grad``)."""
    return (
        query.shape[2] <= DECODE_MAX_QUERIES and DEC.applies(query, key, value, spans) and not grad
    )


@torch.library.custom_op("lssar::triton_softplus_attention", mutates_args=())
def triton_softplus_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    log_n: bool,
    qk_norm: bool,
    p: float | None,
    precise: bool,
    deterministic: bool = False,
    for_backward: bool = True,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    sink_lo: Tensor | None = None,
    sink_hi: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused forward. ``q (B,H_q,T_q,D)``, ``k (B,H_kv,T_k,D)``, ``v (B,H_kv,T_k,D_v)`` ->
    ``(out (B,H_q,T_q,D_v)`` in ``q``'s dtype, ``stats (4,B,H_q,T_q)`` fp32: N, mu, x_max, W,
    ``aux`` fp32: LSSAR's ``(B,H_q,T_q,2,BDV)`` vectors for ``F_i`` and ``D_i`` when
    ``for_backward``, else empty).

    ``scale`` is ``ln(D)`` when ``log_n`` (then ``c_i = scale * ln N_i``), else the constant ``c``;
    ``qk_norm`` L2-normalises ``q`` and ``k`` in-kernel; ``p`` is the re-weighting power or None;
    ``precise`` splits half-precision weights into two products, ``deterministic`` keeps the
    backward's dq in its own kernel (see :func:`triton_attention`).
    ``lo .. sink_hi``: a :class:`lssar.ops.spans.KeySpans`' ``(T_q,)`` vectors (documents, a
    window, sinks; ``is_causal`` folded in), or None.
    """
    spans = _spans(lo, hi, sink_lo, sink_hi, k.shape[2])
    args = (q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, spans)
    return _forward(*args, for_backward=for_backward)


@triton_softplus_attention_op.register_fake
def _triton_attention_fake(q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise,
                           deterministic=False, for_backward=True, *spans):  # fmt: skip
    B, H, t_q, _ = q.shape
    return (
        q.new_empty(B, H, t_q, v.shape[-1]),
        q.new_empty(4, B, H, t_q, dtype=torch.float32),
        q.new_empty(_aux_shape(q, v, p, for_backward), dtype=torch.float32),
    )


@torch.library.custom_op("lssar::triton_softplus_attention_backward", mutates_args=())
def triton_softplus_attention_backward_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    mask: Tensor | None,
    stats: Tensor,
    aux: Tensor,
    is_causal: bool,
    scale: float,
    log_n: bool,
    qk_norm: bool,
    p: float | None,
    precise: bool,
    deterministic: bool,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    sink_lo: Tensor | None = None,
    sink_hi: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused backward: ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``; dk/dv summed over
    each GQA group."""
    spans = _spans(lo, hi, sink_lo, sink_hi, k.shape[2])
    args = (is_causal, scale, log_n, qk_norm, p, precise, deterministic, spans)
    return _backward(grad, q, k, v, out, mask, stats, aux, *args)


@triton_softplus_attention_backward_op.register_fake
def _triton_attention_backward_fake(grad, q, k, v, out, mask, stats, aux, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, log_n, qk_norm, p, precise, deterministic, _, *spans = inputs
    out, stats, aux = output
    ctx.save_for_backward(q, k, v, out, mask, stats, aux, *spans)
    ctx.args = (is_causal, scale, log_n, qk_norm, p, precise, deterministic)
    ctx.mark_non_differentiable(stats, aux)


def _autograd_backward(ctx, grad, _grad_stats, _grad_aux):
    q, k, v, out, mask, stats, aux, *spans = ctx.saved_tensors
    dq, dk, dv = triton_softplus_attention_backward_op(
        grad.contiguous(), q, k, v, out, mask, stats, aux, *ctx.args, *spans
    )
    return dq, dk, dv, *(None,) * (9 + len(spans))


triton_softplus_attention_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_attention(
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
    precise: bool = True,
    deterministic: bool = False,
    spans: KeySpans | None = None,
) -> Tensor:
    """Fused softplus-l1 attention (lssa, lssar, softplus-l1; any ``p``) on Triton.

    Same contract as :func:`lssar.ops.reference.reference_attention`:
    ``query (B, H_q, T_q, D)``, ``key (B, H_kv, T_k, D)``, ``value (B, H_kv, T_k, D_v)`` ->
    ``(B, H_q, T_q, D_v)`` in the input dtype. ``attn_mask`` is boolean (True = may attend),
    broadcastable to ``(B, H_q, T_q, T_k)``, combinable with ``is_causal`` (bottom-right aligned).
    Rows with no visible key are 0 with 0 gradients. Needs CUDA tensors, or ``TRITON_INTERPRET=1``
    for CPU tensors; float64 inputs are refused here (``lssar.attention`` runs them on
    ``impl="chunked"``). ``precise=False`` trades half-precision accuracy for speed (see the module
    docstring); through the public API: ``lssar.attention(..., impl="triton",
    impl_options={"precise": False})``. The arguments are checked by ``lssar.attention``.
    ``spans`` (:class:`lssar.ops.spans.KeySpans`, from ``lssar.attention``'s ``cu_seqlens``,
    ``window``, ``sink_tokens``; ``is_causal`` folded in): row ``i`` sees only the keys of its
    spans, ``N_i`` counts them (with ``attn_mask``), and each program visits only the key blocks
    (dk/dv: the query blocks) its rows' spans reach: O(T W) work for a window W.
    """
    if dropout_p > 0:
        raise ValueError("impl='triton' has no dropout; use impl='reference' for dropout_p > 0")
    if not variant.softplus_l1:
        raise ValueError(f"impl='triton' runs the softplus-l1 variants, not {variant.name!r}")
    if query.dtype == torch.float64:  # lssar.attention runs these on impl='chunked'
        raise ValueError(
            "impl='triton' has no float64 kernels; lssar.attention(..., impl='triton') runs "
            "float64 inputs on impl='chunked' (same math)"
        )
    if not query.is_cuda and not _interpreting():
        raise RuntimeError(
            f"impl='triton' needs a CUDA device or TRITON_INTERPRET=1 (got {query.device} "
            "tensors; the variable must be set before triton is first imported)"
        )
    d, dv = query.shape[-1], value.shape[-1]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"impl='triton' supports head dims up to {MAX_HEAD_DIM}, got {d}, {dv}")
    c, log_n = variant.softplus_scale(d, scale, options)
    p = options.get("p")
    if variant.qk_norm:  # divide by the largest entry first: the in-kernel norm then sees
        # |x| in [1, sqrt(D)] (no eps, no overflow) at every scale; exact, the cosine is invariant
        query, key = _unit_scale(query), _unit_scale(key)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if _decode_step(query, key, value, spans, grad):
        args = (float(c), log_n, bool(variant.qk_norm), None if p is None else float(p))
        return triton_softplus_decode_op(
            query, key, value, attn_mask, bool(is_causal), *args, bool(precise)
        )
    out, _, _ = triton_softplus_attention_op(
        query,
        key,
        value,
        attn_mask,
        bool(is_causal),
        float(c),
        log_n,
        bool(variant.qk_norm),
        None if p is None else float(p),
        bool(precise),
        bool(deterministic),
        grad,
        *(() if spans is None else (spans.lo, spans.hi, spans.sink_lo, spans.sink_hi)),
    )
    return out


__all__ = ["triton_attention", "triton_softplus_attention_op"]
