"""Name -> variant, impl -> lazy entry; ``impl="auto"`` picks the best implementation available.

The registry owns its backends, as transformers' attention interface does: each implementation
is an :class:`Impl` entry with a loader that imports its function on first use, what it runs
(``supports``), whether it can run here (``available``), its own options
(``impl_options`` of :func:`lssar.ops.api.attention`) and the fallbacks it relies on (dropout,
float64). No backend module imports this one. Resolution (:func:`resolve`) is the one place that
validates names and options and routes a call, so :func:`lssar.ops.common.check_inputs` runs
once per call; :func:`check` is its validation without tensors (a spec, when configured).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

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
    result, so :func:`lssar.ops.api.attention` need not zero them first
    (:func:`lssar.ops.common.hide_unseen`: a pass over the whole cache in a decode step).
    ``key_norms``: it takes ``key_norms=`` (the keys' inverse norms a KV cache keeps,
    :func:`lssar.ops.api.attention`) instead of computing them at every call.
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
    """What :func:`lssar.ops.api.attention` runs: the variant, the impl's name and both sets of
    options."""

    variant: Variant
    impl: str
    options: dict[str, Any]
    impl_options: dict[str, Any]


def _named(
    variant: str,
    impl: str,
    options: Mapping[str, Any],
    impl_options: Mapping[str, Any] | None,
    alibi: bool,
) -> tuple[Variant, dict[str, Any]]:
    """The checks that need no impl: the variant, its options, ``impl_options`` only with a
    named impl, ALiBi only for a biasable variant. Returns the variant and its options."""
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
    return v, opts


def _runs(
    impl: str,
    v: Variant,
    opts: dict[str, Any],
    impl_options: Mapping[str, Any] | None,
    dropout_p: float,
    alibi: bool,
    spans: bool,
) -> tuple[Impl, dict[str, Any]]:
    """The checks of a named impl against its entry's declared support: it exists and runs
    here, runs the variant with ``opts``, takes ALiBi / spans / dropout when asked, and its own
    options are valid. Returns the entry and those options."""
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
    return entry, impl_opts


def check(
    variant: str,
    impl: str = "auto",
    options: Mapping[str, Any] | None = None,
    impl_options: Mapping[str, Any] | None = None,
    dropout_p: float = 0.0,
    alibi: bool = False,
    spans: bool = False,
) -> Resolved:
    """Validate a call's names and options without tensors: what :func:`resolve` checks before
    it looks at any input, read from the entries' declared support (``supports``, ``options``,
    ``dropout``, ``alibi``, ``spans``), so a spec can be checked when it is configured.

    ``ValueError`` saying what is wrong and what would run (an unknown variant or option, an
    impl that does not exist here, does not run the variant with these options, or lacks
    dropout / ALiBi / spans). Returns ``(variant, impl, resolved options, impl options)`` with
    ``impl`` as named: ``"auto"`` is picked per call, and the float64 fallback and the
    ``torch.func`` rule depend on the call too (:func:`resolve`).
    """
    v, opts = _named(variant, impl, dict(options or {}), impl_options, alibi)
    if impl == "auto":
        return Resolved(v, impl, opts, {})
    _, impl_opts = _runs(impl, v, opts, impl_options, dropout_p, alibi, spans)
    return Resolved(v, impl, opts, impl_opts)


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
    """Validate names and options (:func:`check`) and route the call (``auto``, dropout, the
    float64 fallback; ``alibi``: the call has ``alibi_slopes``; ``spans``: documents or a window).

    Returns ``(variant, impl name, resolved options, impl options)``; the impl named there is
    the one that runs (``impl="triton"`` with float64 inputs resolves to ``"chunked"``, whose
    options are then the defaults: the requested kernel's options concern its own precision).
    """
    v, opts = _named(variant, impl, options, impl_options, alibi)
    if impl == "auto":
        impl = _auto(query, key, dropout_p, v, opts, alibi)
    entry, impl_opts = _runs(impl, v, opts, impl_options, dropout_p, alibi, spans)
    runs = entry
    if query.dtype == torch.float64 and entry.float64 is not None:
        runs, impl_opts = BACKENDS[entry.float64], {}
    if _functorch_active() and not (entry.torch_func and runs.torch_func):
        raise ValueError(
            f"impl={impl!r} does not run under torch.func transforms (grad, vmap, jacrev); "
            "use impl='auto' or impl='reference' there"
        )
    return Resolved(v, runs.name, opts, impl_opts)


def __getattr__(name: str) -> Any:
    # attention() lived here before lssar.ops.api; the old import still works. Looked up on
    # first use by importlib, not an import statement: api imports this module, and the
    # registry depends on nothing above it
    if name == "attention":
        return importlib.import_module("lssar.ops.api").attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
