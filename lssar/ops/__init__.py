"""Attention as pure functions: the public names of the op layer.

``from lssar.ops import attention, get_variant, ...``: :data:`__all__` is the public API, each
name loaded from its module on first use (importing ``lssar.ops`` loads neither torch nor a
backend). Where each lives:

- :mod:`lssar.ops.api`: :func:`attention`, SDPA's signature with the paper's variants;
- :mod:`lssar.ops.registry`: name -> variant, impl -> lazy entry (:data:`IMPLS`, :data:`BACKENDS`,
  :class:`Impl`, :func:`register_impl`), lookup and listings (:func:`get_variant`,
  :func:`supporting`, :func:`implementations`, :data:`ALIBI_VARIANTS`; the variants' listing
  is ``lssar.variants()``, since ``lssar.ops.variants`` is the module below), routing
  (:func:`resolve`, its answer a :class:`Resolved`) and its check without tensors
  (:func:`check`);
- :mod:`lssar.ops.variants`: the math as data (:class:`Variant`, :data:`VARIANTS`);
- :mod:`lssar.ops.spans`: documents, windows and sinks as per-row key ranges (:class:`KeySpans`,
  from :func:`key_spans`);
- :mod:`lssar.ops.reference`: the materialised ground truth (:func:`reference_attention`,
  :func:`attention_weights`);
- :mod:`lssar.ops.decode`: a decode step over a KV cache (:func:`is_decode_step`,
  :func:`decode_applies`, :func:`key_inverse_norms`, what a cache keeps for ``key_norms``).

The kernels (:mod:`~lssar.ops.chunked`, :mod:`~lssar.ops.cpu`, :mod:`~lssar.ops.sdpa`,
:mod:`~lssar.ops.flex`, :mod:`~lssar.ops.triton`) are reached through the registry, not from here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lssar.ops.api import attention
    from lssar.ops.decode import decode_applies, is_decode_step, key_inverse_norms
    from lssar.ops.reference import attention_weights, reference_attention
    from lssar.ops.registry import (
        ALIBI_VARIANTS,
        BACKENDS,
        IMPLS,
        Impl,
        Resolved,
        check,
        get_variant,
        implementations,
        register_impl,
        resolve,
        supporting,
    )
    from lssar.ops.spans import KeySpans, key_spans
    from lssar.ops.variants import VARIANTS, Variant

# public name -> the module that defines it
_HOME = {
    "attention": "api",
    **dict.fromkeys(
        (
            "ALIBI_VARIANTS",
            "BACKENDS",
            "IMPLS",
            "Impl",
            "Resolved",
            "check",
            "get_variant",
            "implementations",
            "register_impl",
            "resolve",
            "supporting",
        ),
        "registry",
    ),
    "VARIANTS": "variants",
    "Variant": "variants",
    "KeySpans": "spans",
    "key_spans": "spans",
    "attention_weights": "reference",
    "reference_attention": "reference",
    "decode_applies": "decode",
    "is_decode_step": "decode",
    "key_inverse_norms": "decode",
}

__all__ = [
    "ALIBI_VARIANTS",
    "BACKENDS",
    "IMPLS",
    "VARIANTS",
    "Impl",
    "KeySpans",
    "Resolved",
    "Variant",
    "attention",
    "attention_weights",
    "check",
    "decode_applies",
    "get_variant",
    "implementations",
    "is_decode_step",
    "key_inverse_norms",
    "key_spans",
    "reference_attention",
    "register_impl",
    "resolve",
    "supporting",
]


def __getattr__(name: str) -> Any:
    # an unknown name raises AttributeError, so `from lssar.ops import chunked` finds the module
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # found directly from now on (as torch.compile reads it)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
