"""Name -> variant, impl -> lazy entry; ``impl="auto"`` picks the best implementation available.

The registry owns its backends, as transformers' attention interface does: each implementation
is an :class:`Impl` entry with a loader that imports its function on first use, what it runs
(``supports``), whether it can run here (``available``), its own options
(``impl_options`` of :func:`attention`) and the fallbacks it relies on (dropout, float64). No
backend module imports this one. Resolution (:func:`resolve`) is the one place that validates
names and options and routes a call, so :func:`lssar.ops.common.check_inputs` runs once per call.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lssar.ops.common import as_4d, autocast_dtype, check_alibi, check_inputs, hide_unseen
from lssar.ops.spans import KeySpans, hide_unseen_spans, key_spans
from lssar.ops.variants import VARIANTS, Variant

# Below this many score entries per (batch, head) the materialised reference is as fast (measured
# on 2 CPU cores: equal at T = 128, chunked 2-3x faster fwd+bwd at T = 256).
AUTO_CHUNK_MIN_SCORES = 128 * 128


@dataclass(frozen=True)
class Impl:
    """One implementation: a lazy function plus what it runs and needs.

    ``load`` imports and returns the function (on first use; an ``import`` statement, which
    ``torch.compile`` traces, unlike ``importlib``). The function has the attention signature:
    SDPA's arguments, then ``variant=``, ``options=`` and this entry's keyword-only ``options``
    with their defaults. ``available``: it can run in this process (its package or torch feature
    exists, checked without importing the backend); ``needs`` says what it takes, in words.
    ``dropout``: it applies ``dropout_p`` itself (else ``dropout_p > 0`` is an error naming it).
    ``float64``: the impl that runs float64 inputs in its place (same math), or None.
    ``torch_func``: it composes with ``torch.func`` transforms (hand-written backward passes
    do not). ``alibi``: it takes ``alibi_slopes`` (ALiBi's score bias) for the variants it runs
    whose scores can be biased (:data:`ALIBI_VARIANTS`). ``spans``: it takes ``spans=``
    (:class:`lssar.ops.spans.KeySpans`: packed documents, sliding windows, sink tokens).
    ``hides(query, key, value)``: for this call the impl lets no masked key or value into a
    result, so :func:`attention` need not zero them first (:func:`hide_unseen`: a pass over the
    whole cache in a decode step). ``key_norms``: it takes ``key_norms=`` (the keys' inverse
    norms a KV cache keeps, :func:`attention`) instead of computing them at every call.
    """

    name: str
    load: Callable[[], Callable[..., Tensor]]
    supports: Callable[[Variant, dict[str, Any]], bool]
    summary: str
    available: bool = True
    needs: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    dropout: bool = False
    float64: str | None = None
    torch_func: bool = True
    alibi: bool = False
    spans: bool = False
    hides: Callable[[Tensor, Tensor, Tensor], bool] | None = None
    key_norms: bool = False

    @property
    def fn(self) -> Callable[..., Tensor]:
        """The implementation's function (imported on the first call)."""
        return self.load()

    def check_options(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """``given`` validated against :attr:`options`: names, types, counts ``>= 0``."""
        if not given:
            return {}
        if not isinstance(given, Mapping):
            raise ValueError(f"impl_options must be a dict, got {type(given).__name__}")
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            valid = ", ".join(f"{k}={v!r}" for k, v in self.options.items()) or "none"
            raise ValueError(
                f"impl {self.name!r} takes no option {', '.join(map(repr, unknown))}; "
                f"its options are: {valid}"
            )
        for key, value in given.items():
            default = self.options[key]
            if isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            else:
                ok = isinstance(value, type(default))
            if not ok:
                kind = "an int >= 0" if type(default) is int else type(default).__name__
                raise ValueError(f"impl {self.name!r} option {key!r} must be {kind}, got {value!r}")
        return dict(given)


def _softplus_l1(v: Variant, opts: dict[str, Any]) -> bool:
    return v.softplus_l1


def _softmax_family(v: Variant, opts: dict[str, Any]) -> bool:
    return v.phi == "exp" and opts.get("p") is None


def _lssa_family(v: Variant, opts: dict[str, Any]) -> bool:
    return v.lssa_family


def _every_variant(v: Variant, opts: dict[str, Any]) -> bool:
    return True


def _reference() -> Callable[..., Tensor]:
    from lssar.ops.reference import reference_attention

    return reference_attention


def _chunked() -> Callable[..., Tensor]:
    from lssar.ops.chunked import chunked_attention

    return chunked_attention


def _cpu() -> Callable[..., Tensor]:
    from lssar.ops.chunked import cpu_attention

    return cpu_attention


def _chunked_decode(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """The ``chunked`` call is a decode step on its eager decode (which lets no masked key or
    value into a result)."""
    from lssar.ops.decode import is_decode_step

    return is_decode_step(query, key, value)


def _cpu_decode(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """The ``cpu`` call is a decode step on the kernel's decode entry (which reads no masked
    key or value)."""
    from lssar.ops.decode import decode_applies

    return decode_applies(query, key, value)


def _sdpa() -> Callable[..., Tensor]:
    from lssar.ops.sdpa import sdpa_attention

    return sdpa_attention


def _triton() -> Callable[..., Tensor]:
    from lssar.ops.triton.host import triton_attention

    return triton_attention


def _flex() -> Callable[..., Tensor]:
    from lssar.ops.flex import flex_attention_impl

    return flex_attention_impl


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _has_flex() -> bool:
    try:  # AuxRequest (the log-sum-exp) arrived in torch 2.9
        from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401
    except ImportError:
        return False
    return True


# impl name -> entry: every implementation this package has (BACKENDS) and those that can run
# in this process (IMPLS), in registration order
BACKENDS: dict[str, Impl] = {}
IMPLS: dict[str, Impl] = {}


def register_impl(entry: Impl) -> None:
    """Add (or replace) an implementation; ``entry.float64`` must name an available impl."""
    if entry.float64 is not None and entry.float64 not in IMPLS:
        raise ValueError(f"impl {entry.name!r} falls back to unknown impl {entry.float64!r}")
    BACKENDS[entry.name] = entry
    if entry.available:
        IMPLS[entry.name] = entry
    else:
        IMPLS.pop(entry.name, None)


for _entry in (
    Impl(
        "reference",
        _reference,
        _every_variant,
        "materialised T_q x T_k, every variant",
        dropout=True,
        alibi=True,
        spans=True,
    ),
    Impl(
        "chunked",
        _chunked,
        _softplus_l1,
        "memory-efficient exact softplus-l1 family (lssa, lssar, softplus-l1; any p)",
        options={"block": 0},
        torch_func=False,
        spans=True,
        hides=_chunked_decode,
    ),
    Impl(
        "cpu",
        _cpu,
        _softplus_l1,
        "fused C++ CPU kernel for the softplus-l1 family (lssa, lssar, softplus-l1; any p), "
        "built once and cached; where it cannot be built, chunked's eager path with a warning",
        options={"block": 0},
        float64="chunked",
        torch_func=False,
        spans=True,
        hides=_cpu_decode,
        key_norms=True,
    ),
    Impl(
        "sdpa",
        _sdpa,
        _softmax_family,
        "torch SDPA kernels for softmax, ssmax, softmax-qknorm-logn / -const / -learned (no p); "
        "ALiBi by query blocks with a float bias per block",
        dropout=True,
        alibi=True,
        spans=True,
    ),
    Impl(
        "triton",
        _triton,
        _softplus_l1,
        "fused Triton kernels for the softplus-l1 family (lssa, lssar, softplus-l1; any p); "
        "CUDA, or CPU with TRITON_INTERPRET=1",
        available=_has_triton(),
        needs="the triton package",
        options={"precise": True, "deterministic": False},
        float64="chunked",
        torch_func=False,
        spans=True,
    ),
    Impl(
        "flex",
        _flex,
        _lssa_family,
        "FlexAttention (torch.compile): lssa in one call, lssar in two (any p); CPU inference-only",
        available=_has_flex(),
        needs="torch.nn.attention.flex_attention with AuxRequest (torch >= 2.9)",
        float64="chunked",
        spans=True,
    ),
):
    register_impl(_entry)


def _biasable(v: Variant) -> bool:
    """ALiBi adds to the logits of a softmax: the variants whose ``phi`` is exp."""
    return v.phi == "exp"


# the variants whose scores ALiBi can bias (the softmax family), for error messages
ALIBI_VARIANTS = tuple(name for name, v in VARIANTS.items() if _biasable(v))


def get_variant(name: str) -> Variant:
    """The :class:`Variant` called ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention variant {name!r}; valid variants: {', '.join(VARIANTS)}"
        ) from None


def supporting(variant: str, options: dict[str, Any] | None = None) -> list[str]:
    """The available implementations that run ``variant`` with ``options`` (the test grid)."""
    v = get_variant(variant)
    opts = v.resolve(options or {})
    return [name for name, entry in IMPLS.items() if entry.supports(v, opts)]


def variants() -> list[dict[str, Any]]:
    """Every variant: name, one-line summary, options with defaults, and the impls that run it."""
    return [
        {
            "name": v.name,
            "summary": v.summary,
            "options": dict(v.options),
            "impls": [name for name, e in IMPLS.items() if e.supports(v, v.options)],
        }
        for v in VARIANTS.values()
    ]


def implementations() -> list[dict[str, Any]]:
    """Every implementation: name, summary, whether it runs here (and what it needs), options."""
    return [
        {
            "name": e.name,
            "summary": e.summary,
            "available": e.available,
            "needs": e.needs,
            "options": dict(e.options),
        }
        for e in BACKENDS.values()
    ]


def _functorch_active() -> bool:
    """Inside torch.func.grad / vmap / jacrev: the fused kernels' autograd formulas do not
    compose with these transforms, the reference's autograd does."""
    return bool(torch._C._are_functorch_transforms_active())


def _auto(
    query: Tensor,
    key: Tensor,
    dropout_p: float,
    variant: Variant,
    opts: dict[str, Any],
    alibi: bool = False,
) -> str:
    if alibi:  # SDPA by query blocks (O(T * block)); the reference for p and torch.func
        fam = _softmax_family(variant, opts) and not _functorch_active()
        return "sdpa" if fam else "reference"
    if dropout_p > 0 or (_functorch_active() and not _softmax_family(variant, opts)):
        return "reference"
    if query.is_cuda and "triton" in IMPLS and IMPLS["triton"].supports(variant, opts):
        return "triton"
    if _softmax_family(variant, opts):
        return "sdpa"
    if not _softplus_l1(variant, opts):
        return "reference"
    if _cpu_decode(query, key, key):
        return "cpu"  # its decode entry: the cache read once, in place (benchmarks/decode.py)
    if _chunked_decode(query, key, key):
        return "chunked"  # its eager decode (float64; CUDA without Triton)
    if query.shape[-2] * key.shape[-2] >= AUTO_CHUNK_MIN_SCORES:
        return "cpu" if query.device.type == "cpu" else "chunked"
    return "reference"


class Resolved(NamedTuple):
    """What :func:`attention` runs: the variant, the impl's name and both sets of options."""

    variant: Variant
    impl: str
    options: dict[str, Any]
    impl_options: dict[str, Any]


def resolve(
    variant: str,
    impl: str,
    query: Tensor,
    key: Tensor,
    dropout_p: float,
    options: dict[str, Any],
    impl_options: Mapping[str, Any] | None = None,
    alibi: bool = False,
    spans: bool = False,
) -> Resolved:
    """Validate names and options and route the call (``auto``, dropout, the float64 fallback;
    ``alibi``: the call has ``alibi_slopes``; ``spans``: documents or a window).

    Returns ``(variant, impl name, resolved options, impl options)``; the impl named there is
    the one that runs (``impl="triton"`` with float64 inputs resolves to ``"chunked"``, whose
    options are then the defaults: the requested kernel's options concern its own precision).
    """
    v = get_variant(variant)
    opts = v.resolve(options)
    if impl_options and impl == "auto":
        raise ValueError(
            "impl_options belong to one implementation: pass impl= explicitly with them "
            "(impl='auto' picks per call)"
        )
    if alibi and not _biasable(v):
        raise ValueError(
            f"alibi_slopes biases the scores of the softmax family ({', '.join(ALIBI_VARIANTS)}); "
            f"variant {v.name!r} cannot take it"
        )
    if impl == "auto":
        impl = _auto(query, key, dropout_p, v, opts, alibi)
    entry = BACKENDS.get(impl) if isinstance(impl, str) else None
    if entry is None or not entry.available:
        why = "" if entry is None else f" (needs {entry.needs})"
        raise ValueError(f"unknown impl {impl!r}{why}; valid impls: auto, {', '.join(IMPLS)}")
    if not entry.supports(v, opts):
        ok = [n for n, e in IMPLS.items() if e.supports(v, opts)]
        raise ValueError(
            f"impl {impl!r} does not run variant {v.name!r} with options {opts}; "
            f"use one of: auto, {', '.join(ok)}"
        )
    if alibi and not entry.alibi:
        ok = [n for n, e in IMPLS.items() if e.alibi and e.supports(v, opts)]
        raise ValueError(
            f"impl {impl!r} cannot apply alibi_slopes; use one of: auto, {', '.join(ok)}"
        )
    if spans and not entry.spans:
        ok = [n for n, e in IMPLS.items() if e.spans and e.supports(v, opts)]
        raise ValueError(
            f"impl {impl!r} cannot take cu_seqlens / window / sink_tokens; use one of: auto, "
            f"{', '.join(ok)}"
        )
    impl_opts = entry.check_options(impl_options)
    if dropout_p > 0 and not entry.dropout:
        raise ValueError(f"impl={impl!r} has no dropout; use impl='reference' for dropout_p > 0")
    runs = entry
    if query.dtype == torch.float64 and entry.float64 is not None:
        runs, impl_opts = BACKENDS[entry.float64], {}
    if _functorch_active() and not (entry.torch_func and runs.torch_func):
        raise ValueError(
            f"impl={impl!r} does not run under torch.func transforms (grad, vmap, jacrev); "
            "use impl='auto' or impl='reference' there"
        )
    return Resolved(v, runs.name, opts, impl_opts)


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
        variant: a name from :func:`variants` (``"lssar"``, ``"lssa"``, ``"softmax"``, ...).
        impl: ``"auto"``, ``"reference"``, ``"chunked"``, ``"sdpa"`` (and ``"triton"``,
            ``"flex"`` where available; :func:`implementations` lists them). ``"triton"`` and
            ``"flex"`` run float64 inputs on ``"chunked"`` (same math).
        impl_options: options of the implementation named by ``impl`` (not ``"auto"``), e.g.
            ``{"precise": False}`` for ``"triton"`` (half-precision weights rounded once, as
            FlashAttention does) or ``{"block": 256}`` for ``"chunked"`` (query rows per
            block). An unknown name is a ``ValueError`` listing the valid ones.
        alibi_slopes: ALiBi (Press et al. 2022), as FlashAttention's: float ``(H_q,)`` or
            ``(B, H_q)``, adding ``-slope * |T_k - T_q + i - j|`` to the scores of query ``i``
            and key ``j`` after their scale (bottom-right aligned, as the causal mask). Only the
            softmax family (:data:`ALIBI_VARIANTS`) takes it, on ``"reference"`` and
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
