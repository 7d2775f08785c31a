"""vLLM plugin: lssar attention in vLLM's custom backend slot (:mod:`.vllm_backend`).

Installed with lssar, the ``vllm.general_plugins`` entry point ``lssar`` (``pyproject.toml``)
makes vLLM call :func:`register` in every process it starts, before it parses its arguments.
It registers the lssar backend as vLLM's ``CUSTOM`` attention backend, so ``vllm serve MODEL
--attention-backend CUSTOM`` (or ``LLM(model, attention_backend="CUSTOM")``) runs lssar
attention over vLLM's paged KV cache. Which variant and options: the model config's
``lssar_variant`` (default ``"lssar"``), ``lssar_p``, ``lssar_options`` and ``lssar_impl``, as
for transformers (:func:`lssar.integrations.hf.config_options`); ``--hf-overrides`` sets them
without editing the model directory. Without ``--attention-backend CUSTOM`` nothing changes.

Why the existing ``CUSTOM`` member and not a new ``LSSAR`` one: vLLM sends its config, which
holds the selected member, to its engine process by pickling, and that process unpickles it
before it loads plugins, so only members that exist without the plugin survive the trip.

vLLM 0.32's CPU platform ignores ``--attention-backend`` (it always runs its own ``CPU_ATTN``),
so on CPU :func:`register` also makes the platform honour the ``CUSTOM`` selection; every other
selection still goes to the platform's own rule.
"""

from __future__ import annotations

import logging
from typing import Any

BACKEND_NAME = "CUSTOM"
BACKEND_PATH = "lssar.integrations.vllm_backend.LssarAttentionBackend"


def register() -> None:
    """Put the lssar backend in vLLM's ``CUSTOM`` slot (idempotent: vLLM calls it in every
    process). A slot another plugin filled first is left to it, with a warning."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    slot = AttentionBackendEnum[BACKEND_NAME]
    if slot.is_overridden() and slot.get_path() != BACKEND_PATH:
        logging.getLogger(__name__).warning(
            "vLLM's CUSTOM attention backend is already %s: lssar's is not registered",
            slot.get_path(),
        )
        return
    register_backend(slot, BACKEND_PATH)
    _honour_selection_on_cpu()


def _honour_selection_on_cpu() -> None:
    """On vLLM's CPU platform, route ``--attention-backend CUSTOM`` to the registered class."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    own = platform.get_attn_backend_cls
    if getattr(own, "_lssar", False):
        return

    def get_attn_backend_cls(
        cls: type, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None
    ) -> str:
        if selected_backend is not None and selected_backend.name == BACKEND_NAME:
            if attn_selector_config.use_mla or attn_selector_config.use_sparse:
                raise ValueError(
                    "the lssar attention backend runs standard multi-head / grouped-query "
                    "attention, not MLA or sparse attention: drop --attention-backend CUSTOM"
                )
            return selected_backend.get_path()
        return own(selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._lssar = True  # type: ignore[attr-defined]
    platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore[assignment]
