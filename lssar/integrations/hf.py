"""Hugging Face ``transformers`` integration: LSSAR attention inside any HF model.

:func:`register` adds every lssar variant (``lssar``, ``lssa``, ``softmax``, ...; the names of
:func:`lssar.variants`) to ``transformers.AttentionInterface`` together with a boolean mask
builder in ``AttentionMaskInterface``, so any model that dispatches attention by name (Llama,
Qwen2, Mistral, ...) runs it: ``from_pretrained(..., attn_implementation="lssar")``.
Variant options come from the model config: ``config.lssar_p`` (re-weighting power),
``config.lssar_options`` (a dict of any variant options), ``config.lssar_impl`` (``"auto"``) and
``config.lssar_window`` (an evaluation-time sliding window of that many keys: the locality control).
:func:`register` also registers our GPT with the Auto classes (model type ``lssar-gpt``,
:mod:`lssar.integrations.hf_gpt`, re-exported here with ``export_run`` / ``lssar export-hf``);
``lssar lm-eval`` (lm-evaluation-harness) lives in :mod:`lssar.integrations.lm_eval`.

Masks: HF builds a boolean ``(B, 1, T_q, T_k)`` mask (``True`` = attend) that already holds
causality, padding and the KV-cache offset, so ``N_i`` (the number of keys query ``i`` may attend
to, docs/method.md section 2) comes from the real mask, never from the tensor length. A mask with no
padding whose cache is contiguous and whose rule is causal, a causal sliding window, packed
sequences or both (:func:`lssar.integrations.packing.mask_rule`) is skipped (``None``): the
attention function then passes the same rule to :func:`lssar.attention` as arguments, in O(T)
memory (``is_causal``, bottom-right aligned; ``window=(sliding_window - 1, 0)`` from the
``sliding_window`` the model passes, as its ``flash_attention_2`` path reads it; ``cu_seqlens``
from the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` kwargs or from ``position_ids`` that restart in a
row, :mod:`lssar.integrations.packing`), with the same ``N_i``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import transformers
from torch import Tensor

from lssar.integrations import packing
from lssar.integrations.hf_gpt import (
    TOKENIZER_INFO,
    LssarGPTConfig,
    LssarGPTForCausalLM,
    export_cli,
    export_run,
    hf_tokenizer,
    register_auto,
)
from lssar.ops import VARIANTS, Variant, attention, attention_weights, get_variant, key_spans

__all__ = [
    "TOKENIZER_INFO",
    "LssarGPTConfig",
    "LssarGPTForCausalLM",
    "attention_function",
    "bool_mask",
    "config_options",
    "export_cli",
    "export_run",
    "hf_tokenizer",
    "lm_eval_cli",
    "lssar_mask",
    "register",
]

MIN_TRANSFORMERS = "4.48"
# Extra keyword arguments some HF models pass to their attention function that lssar cannot honour.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def _interfaces() -> tuple[Any, Any]:
    """``(AttentionInterface, AttentionMaskInterface or None)``; ValueError on too old versions."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        raise ValueError(
            f"transformers >= {MIN_TRANSFORMERS} is needed for custom attention (found "
            f"{transformers.__version__}); pip install 'transformers>={MIN_TRANSFORMERS}'"
        ) from None
    try:  # transformers >= 4.53; before it, models build float masks themselves (converted below)
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        AttentionMaskInterface = None  # noqa: N806
    return AttentionInterface, AttentionMaskInterface


def config_options(config: Any, variant: Variant) -> tuple[dict[str, Any], str]:
    """Variant options and impl from an HF config: ``lssar_p``, ``lssar_options``, ``lssar_impl``.

    Raises ``ValueError`` naming the config field that holds a bad value.
    """
    raw = getattr(config, "lssar_options", None) or {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"config.lssar_options must be a dict of {variant.name!r} options, got {raw!r}"
        )
    options = dict(raw)
    try:
        variant.resolve(options)
    except ValueError as e:
        raise ValueError(f"config.lssar_options={raw!r}: {e}") from None
    p = getattr(config, "lssar_p", None)
    if p is not None:
        if "p" not in variant.options:
            raise ValueError(
                f"config.lssar_p={p!r}: attention {variant.name!r} has no re-weighting power p "
                f"(its options: {', '.join(variant.options) or 'none'})"
            )
        try:
            variant.resolve({"p": p})
        except ValueError as e:
            raise ValueError(f"config.lssar_p={p!r}: {e}") from None
        options["p"] = p
    impl = getattr(config, "lssar_impl", None) or "auto"
    if not isinstance(impl, str):
        raise ValueError(f"config.lssar_impl must be an impl name such as 'auto', got {impl!r}")
    return options, impl


def bool_mask(mask: Tensor) -> Tensor:
    """An HF attention mask as lssar's boolean ``True`` = attend (same shape).

    Float masks are additive: 0 = attend, a very negative value (``finfo.min`` or ``-inf``) =
    blocked. Any other value is a bias that lssar's weights cannot absorb, so it is rejected.
    """
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"attention mask must be boolean or additive float, got {mask.dtype}")
    attend = mask == 0
    if not bool((attend | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        raise ValueError(
            "this additive attention mask holds biases other than 0 / -inf, which lssar "
            "attention cannot apply; pass a boolean mask (True = attend)"
        )
    return attend


def attention_function(name: str) -> Callable[..., tuple[Tensor, None]]:
    """The HF attention function for lssar variant ``name`` (``ValueError`` if it is unknown)."""
    variant = get_variant(name)
    length_scaled = variant.scaling == "log_n"

    def lssar_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        """HF signature: query ``(B, H, T_q, D)``, key/value ``(B, H_kv, T_k, D)`` (GQA not
        repeated), mask ``(B, 1, T_q, T_k)`` or None -> ``((B, T_q, H, D) contiguous, None)``.
        """
        for k in _UNSUPPORTED_KWARGS:
            if kwargs.get(k) is not None:
                raise ValueError(f"lssar attention {name!r} does not support `{k}`")
        config = getattr(module, "config", None)
        options, impl = config_options(config, variant)
        b = query.shape[0]
        spans: dict[str, Any] = {}
        docs = None
        if attention_mask is None:
            # HF's mask was skipped (see lssar_mask): causal, no padding, contiguous cache; a
            # sliding window and packed sequences come as arguments, as flash_attention_2 reads
            causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
            spans = _window(kwargs.get("sliding_window"), causal, key.shape[2])
            docs = packing.documents(kwargs, b, query.shape[2], key.shape[2])
            mask = None
        else:
            if not isinstance(attention_mask, Tensor):
                raise ValueError(
                    f"lssar attention needs a tensor mask, got {type(attention_mask).__name__}"
                )
            if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
                raise ValueError(
                    "cu_seq_lens_q / cu_seq_lens_k (packed sequences) came with an attention "
                    "mask (padding): lssar cannot tell which of the mask's tokens belong to which "
                    "sequence; pass packed sequences without padding (DataCollatorWithFlattening)"
                )
            mask, causal = bool_mask(attention_mask), False  # HF masks already hold causality
        spans = _eval_window(
            spans, getattr(config, "lssar_window", None), getattr(config, "lssar_sink_tokens", 0)
        )
        if docs is not None:  # one row of B * T tokens, FlashAttention's varlen layout
            query, key, value = packing.flatten(query), packing.flatten(key), packing.flatten(value)
            spans |= {"cu_seqlens": docs[0], "cu_seqlens_k": docs[1]}
        scale = None if length_scaled else scaling  # LSSA's scale is ln(d) ln(N_i), not 1/sqrt(d)
        gqa = query.shape[1] != key.shape[1]
        out = attention(
            query, key, value, mask, dropout, causal, scale, gqa, variant=name, impl=impl,
            **spans, **options,
        )  # fmt: skip
        if (record := _RECORDING.get()) is not None:
            if docs is not None:
                raise ValueError("attention weights of packed sequences are not recorded")
            with torch.no_grad():
                t_q, t_k = query.shape[2], key.shape[2]
                ks = key_spans(t_q, t_k, query.device, causal, mask, **spans) if spans else None
                w = attention_weights(
                    query, key, mask, causal and ks is None, scale, gqa,
                    variant=variant, options=variant.resolve(options), spans=ks,
                )  # fmt: skip
                record.append(w)
        if docs is not None:
            out = packing.unflatten(out, b)
        return out.transpose(1, 2).contiguous(), None  # (B, T_q, H, D)

    lssar_attention_forward.__qualname__ = f"lssar_attention_forward[{name}]"
    return lssar_attention_forward


# where lssar attention functions append each layer's weights (B, H, T_q, T_k): see recording()
_RECORDING: ContextVar[list | None] = ContextVar("lssar_hf_recording", default=None)


@contextlib.contextmanager
def recording(weights: list | None) -> Iterator[None]:
    """Within it, every lssar attention call appends its final weights ``(B, H, T_q, T_k)``
    (materialised by the reference, float32) to ``weights``; ``None`` records nothing. The
    evaluation's attention diagnostics read them, as from :class:`lssar.model.GPT`."""
    token = _RECORDING.set(weights)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def _window(sliding_window: Any, causal: bool, t_k: int) -> dict[str, Any]:
    """:func:`lssar.attention`'s ``window`` for HF's ``sliding_window`` (each query sees its last
    ``sliding_window`` keys, itself included, as in HF's masks and flash's ``window_size``);
    empty when there is none or it covers every key."""
    if sliding_window is None or t_k <= sliding_window:
        return {}
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")
    if not causal:  # a bidirectional window (|i - j| <= w) is another rule: it needs HF's mask
        raise ValueError("a bidirectional sliding window needs its mask; none was given")
    return {"window": (sliding_window - 1, 0)}


def _eval_window(spans: dict[str, Any], lssar_window: Any, sinks: Any = 0) -> dict[str, Any]:
    """``spans`` with ``config.lssar_window`` (keys per query, the sliding-window control set by
    :func:`lssar.integrations.pretrained.set_attention`) applied: the narrower of it and the
    model's own window; ``config.lssar_sink_tokens`` (``sinks``): the first keys of the sequence
    stay visible beside the window (StreamingLLM's attention sinks)."""
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"config.lssar_sink_tokens must be an int >= 0, got {sinks!r}")
    if lssar_window is None:
        if sinks:
            raise ValueError("config.lssar_sink_tokens needs config.lssar_window (a window)")
        return spans
    if isinstance(lssar_window, bool) or not isinstance(lssar_window, int) or lssar_window < 1:
        raise ValueError(f"config.lssar_window must be an int >= 1, got {lssar_window!r}")
    left = lssar_window - 1
    if "window" in spans:
        left = min(left, spans["window"][0])
    return {**spans, "window": (left, 0)} | ({"sink_tokens": sinks} if sinks else {})


def _skippable(kw: dict[str, Any]) -> bool:
    """Whether the mask HF asks for is lssar's bottom-right ``is_causal``, optionally with a
    sliding window or packed sequences, which the attention function passes as arguments (so
    it can be None)."""
    from transformers.masking_utils import prepare_padding_mask

    needed = ("q_length", "kv_length", "q_offset", "kv_offset")
    if not all(isinstance(kw.get(k), int) for k in needed):  # tensors: static cache / tracing
        return False
    rule = packing.mask_rule(kw.get("mask_function"))
    if rule is None or "causal" not in rule or ("remapped" in rule and "packed" not in rule):
        return False
    if "window" not in rule and kw.get("local_size") is not None:
        return False
    # transformers turns the skip off for packed sequences (SDPA's is_causal cannot hold them);
    # lssar's attention function reads them from the kwargs, as flash_attention_2 does
    if not kw.get("allow_is_causal_skip", True) and "packed" not in rule:
        return False
    if torch.compiler.is_compiling():
        return False
    if kw["q_offset"] - kw["kv_offset"] != kw["kv_length"] - kw["q_length"]:
        return False  # keys not exactly the tokens before the queries (e.g. static cache slots)
    pad = prepare_padding_mask(kw.get("attention_mask"), kw["kv_length"], kw["kv_offset"])
    return pad is None or bool(pad.all())


def lssar_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """``AttentionMaskInterface`` entry: HF's boolean ``sdpa_mask`` ``(B, 1, T_q, T_k)``.

    Returns None for a causal mask, a causal sliding window, packed sequences or both, with no
    padding and a contiguous cache (:func:`_skippable`): there lssar's bottom-right
    ``is_causal``, ``window`` and ``cu_seqlens`` (read by the attention function from the
    model's kwargs) yield the same ``N_i`` without a ``T_q x T_k`` mask. HF's own skip also fires
    for a static cache's empty slots, which relies on SDPA's top-left alignment, so it is turned
    off here.
    """
    from transformers.masking_utils import sdpa_mask

    if not args and _skippable(kwargs):
        return None
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


def register(names: list[str] | None = None) -> list[str]:
    """Register lssar attention (default: every variant) and the ``lssar-gpt`` model with HF.

    Idempotent. After it, ``attn_implementation="<variant>"`` works in ``from_pretrained`` /
    ``from_config``, and ``AutoModelForCausalLM`` loads exported lssar GPTs. Returns the names.
    """
    attn_interface, mask_interface = _interfaces()
    names = list(VARIANTS) if names is None else list(names)
    for name in names:
        fn = attention_function(name)  # ValueError for an unknown name, before registering any
        attn_interface.register(name, fn)
        if mask_interface is not None:
            mask_interface.register(name, lssar_mask)
    register_auto()
    return names


def lm_eval_cli(argv: list[str]) -> int:
    """``lssar lm-eval``: see :func:`lssar.integrations.lm_eval.cli`."""
    from lssar.integrations.lm_eval import cli

    return cli(argv)
