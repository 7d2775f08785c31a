"""lssar attention as a vLLM attention backend, over vLLM's paged KV cache.

Registered in vLLM's ``CUSTOM`` slot by :mod:`lssar.integrations.vllm_plugin` (read it
first). vLLM hands each attention layer a batch of requests flattened into one token axis:
query ``(T, H, D)``, the new keys and values ``(T, H_kv, D)``, and per request its query span
(``query_start_loc``), its sequence length (cached + new tokens) and its block table. The
backend writes the new keys and values into the cache (:meth:`LssarAttentionImpl.
do_kv_cache_update`), then, per request, reads its keys back through its block table and calls
:func:`lssar.attention` with ``is_causal=True``, which aligns the queries bottom-right: query
``t`` of ``T_q`` new tokens sits at position ``L - T_q + t`` of a sequence of ``L`` tokens and
sees ``N_i = L - T_q + t + 1`` keys (its own sequence, never another request's). So a prefill
(``T_q = L``), a chunked prefill or a prompt whose prefix was cached (``T_q < L``) all count
``N_i`` from the sequence, as in one process. Requests with one new token (decode steps) go
together as one batch with a key-padding mask, so ``impl="auto"`` sends them to the decode
path (``cpu``: the fused kernel's decode entry, which reads no masked key); prefills go to the
fused prefill kernels.

Cache layout: vLLM's ``LBNHC`` (per layer ``(blocks, block_size, H_kv, D + D_v)``, keys then
values along the last axis), any block size, the model's dtype (no fp8 cache).
Not supported (a one-line error when the model asks for it): ALiBi, logit soft-capping,
attention sinks, encoder or cross attention, non-causal attention, MLA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from lssar.integrations.hf import config_options
from lssar.integrations.vllm_plugin import BACKEND_NAME
from lssar.ops import attention, get_variant


class LssarAttentionBackend(AttentionBackend):
    """vLLM's description of the backend: what it runs, its cache layout, its classes."""

    forward_includes_kv_cache_update = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[LssarAttentionImpl]:
        return LssarAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[LssarMetadataBuilder]:
        return LssarMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)  # a block's tokens, each with its heads' keys and values

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class LssarMetadata:
    """One batch: ``num_actual_tokens`` real tokens (the rest of the token axis is padding),
    per request its query span ``query_start_loc[i] : query_start_loc[i + 1]`` and its sequence
    length ``seq_lens[i]`` (host lists), and ``block_table (requests, max blocks)``."""

    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: Tensor


class LssarMetadataBuilder(AttentionMetadataBuilder[LssarMetadata]):
    """Builds :class:`LssarMetadata` from vLLM's common metadata, once per step."""

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> LssarMetadata:
        m = common_attn_metadata
        if not (isinstance(m.causal, bool) and m.causal):
            raise ValueError(
                "the lssar attention backend runs causal decoder attention only; this model "
                "asks for non-causal or per-request causality: use another --attention-backend"
            )
        n = m.num_reqs
        return LssarMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: n + 1].tolist(),
            seq_lens=m.seq_lens[:n].cpu().tolist(),
            block_table=m.block_table_tensor[:n],
        )


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"the lssar attention backend does not support {what}; serve this model with another "
        "--attention-backend"
    )


class LssarAttentionImpl(AttentionImpl[LssarMetadata]):
    """One attention layer: the variant and options come from the model's config."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: Tensor | None = None,
        **unknown: Any,
    ) -> None:
        for what, given in (
            ("ALiBi (alibi_slopes)", alibi_slopes),
            ("logit soft-capping", logits_soft_cap),
            ("attention sinks", sinks),
        ):
            if given is not None:
                raise _refuse(what)
        if attn_type != AttentionType.DECODER:
            raise _refuse(f"{attn_type} attention")
        if kv_cache_dtype not in LssarAttentionBackend.supported_kv_cache_dtypes:
            raise _refuse(f"kv_cache_dtype={kv_cache_dtype!r} (use 'auto')")
        extra = sorted(k for k, v in unknown.items() if v is not None)
        if extra:
            raise _refuse(", ".join(extra))
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = sliding_window
        hf_config = get_current_vllm_config().model_config.hf_config
        name = getattr(hf_config, "lssar_variant", None) or "lssar"
        try:
            variant = get_variant(name)
        except ValueError as e:
            raise ValueError(f"config.lssar_variant: {e}") from None
        self.variant = variant.name
        self.options, self.impl = config_options(hf_config, variant)
        # the length-scaled and constant-scale variants set their own scale and take none
        self.call_scale = None if variant.scaling in ("log_n", "const") else self.scale
        self.window = None if sliding_window is None else (sliding_window - 1, 0)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        """Write the new keys and values ``(T, H_kv, D)`` at their slots (``block * block_size
        + offset``; a negative slot marks a padding token, which is not written)."""
        slots = slot_mapping.long()
        key, value = key[: slots.shape[0]], value[: slots.shape[0]]
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        flat = _tokens(kv_cache)  # (blocks * block_size, H_kv, D + D_v), a view
        flat[slots, :, : self.head_size] = key.to(flat.dtype)
        flat[slots, :, self.head_size :] = value.to(flat.dtype)

    def forward(
        self,
        layer: AttentionLayer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: LssarMetadata | None,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        """``output[:T] (T, H, D_v)`` = attention of ``query (T, H, D)`` over each request's
        cached keys (the new ones already written by :meth:`do_kv_cache_update`)."""
        if output_scale is not None or output_block_scale is not None:
            raise _refuse("fused output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no cache, no requests
            return output.fill_(0)
        m = attn_metadata
        cache = kv_cache.transpose(1, 2)  # (blocks, block_size, H_kv, D + D_v)
        starts, lens = m.query_start_loc, m.seq_lens
        decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
        if decodes:
            self._decode(query, cache, m, decodes, output)
        for i in range(len(lens)):
            q0, q1 = starts[i], starts[i + 1]
            if q1 - q0 <= 1:  # no token this step, or a decode step (done above)
                continue
            keys = _gather(cache, m.block_table[i], lens[i])  # (L, H_kv, D + D_v)
            q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # (1, H, T_q, D)
            out = self._attend(q, keys.unsqueeze(0), None)  # (1, H, T_q, D_v)
            output[q0:q1] = out[0].transpose(0, 1).to(output.dtype)
        return output

    def _decode(
        self, query: Tensor, cache: Tensor, m: LssarMetadata, rows: list[int], output: Tensor
    ) -> None:
        """The requests ``rows`` (one new token each) as one batch: one call of the decode path
        for all of them. Each request's keys end at the batch's last key (padded and masked on
        the left), so the bottom-right causal rule and a sliding window see its own positions."""
        lens = [m.seq_lens[i] for i in rows]
        longest = max(lens)
        keys = cache.new_zeros((len(rows), longest) + cache.shape[2:])  # (R, L, H_kv, D + D_v)
        for r, i in enumerate(rows):
            keys[r, longest - lens[r] :] = _gather(cache, m.block_table[i], lens[r])
        dev = cache.device
        first = longest - torch.tensor(lens, device=dev).unsqueeze(1)  # (R, 1)
        seen = torch.arange(longest, device=dev) >= first  # (R, L)
        at = torch.tensor([m.query_start_loc[i] for i in rows], device=dev)
        q = query[at].unsqueeze(2)  # (R, H, 1, D)
        out = self._attend(q, keys, seen[:, None, None, :])  # (R, H, 1, D_v)
        output[at] = out[:, :, 0].to(output.dtype)

    def _attend(self, q: Tensor, keys: Tensor, mask: Tensor | None) -> Tensor:
        """``q (B, H, T_q, D)`` over ``keys (B, L, H_kv, D + D_v)`` (keys then values)."""
        k = keys[..., : self.head_size].transpose(1, 2)  # (B, H_kv, L, D)
        v = keys[..., self.head_size :].transpose(1, 2)  # (B, H_kv, L, D_v)
        return attention(
            q,
            k,
            v,
            mask,
            0.0,
            True,
            self.call_scale,
            self.num_heads != self.num_kv_heads,
            variant=self.variant,
            impl=self.impl,
            **({"window": self.window} if self.window is not None else {}),
            **self.options,
        )


def _tokens(kv_cache: Tensor) -> Tensor:
    """A layer's cache ``(blocks, H_kv, block_size, D + D_v)`` (``LBNHC`` strides) as
    ``(blocks * block_size, H_kv, D + D_v)``, a view: slot ``s`` is row ``s``."""
    return kv_cache.transpose(1, 2).flatten(0, 1)


def _gather(cache: Tensor, blocks: Tensor, length: int) -> Tensor:
    """The first ``length`` tokens of one request ``(length, H_kv, D + D_v)`` from ``cache
    (blocks, block_size, H_kv, D + D_v)`` through its block table row ``blocks``."""
    n = -(-length // cache.shape[1])
    return cache[blocks[:n].long()].flatten(0, 1)[:length]
