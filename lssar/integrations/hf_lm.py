"""A Hugging Face causal LM behind the GPT's evaluation interface, so ``lssar eval`` measures a
pretrained or converted model with the same code as its own runs (loss by length and position,
the window controls, eval-time RoPE scaling, attention diagnostics, passkey and copy probes).

:class:`HFCausalLM` wraps the model: ``lm(idx, targets, reduction="none", window=W)`` returns
``(logits, loss)`` as :class:`lssar.model.GPT` does, ``weights=[]`` collects each layer's attention
weights, and :meth:`HFCausalLM.switch` changes the attention rule and the RoPE scaling as
:meth:`lssar.model.GPT.switch` does. Attention always runs through lssar's ``AttentionInterface``
functions (``softmax`` for a model that ran SDPA: the same rule), so a window applies to every arm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lssar.integrations import hf
from lssar.integrations.pretrained import max_positions, set_attention
from lssar.positions import RopeScaling, hf_rope_parameters
from lssar.spec import AttentionSpec

LOGIT_CHUNK = 1024  # positions per lm-head chunk: a 16K window's logits would take 3 GB at once


class _Cfg:
    """The fields of :class:`lssar.model.GPTConfig` the evaluation reads."""

    def __init__(self, config: Any) -> None:
        self.n_layer = int(config.num_hidden_layers)


class HFCausalLM(torch.nn.Module):
    """An HF causal LM (``transformers``' ``*ForCausalLM`` whose attention dispatches by name)
    evaluated as an lssar GPT. ``attn`` is the rule it runs (its config's lssar attention, or
    ``softmax`` for transformers' own SDPA/eager)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.cfg = _Cfg(model.config)
        impl = model.config._attn_implementation
        name = impl if impl in hf.VARIANTS else "softmax"
        opts = dict(getattr(model.config, "lssar_options", None) or {})
        if getattr(model.config, "lssar_p", None) is not None:
            opts["p"] = model.config.lssar_p
        self.attn_spec = AttentionSpec(name, opts)
        self.rope_scaling: RopeScaling | None = None
        self._theta = float(_rope_base(model.config))
        self._rope_len: int | None = None  # the length the rotary module is built for
        self._apply_attention()

    def _apply_attention(self) -> None:
        opts = dict(self.attn_spec.options)
        set_attention(self.model, self.attn_spec.name, opts.pop("p", None), **opts)

    # ------------------------------------------------------------------ GPT's eval interface

    def switch(
        self,
        attn: str | None = None,
        attn_p: float | None = None,
        rope_scaling: str | None = None,
        rope_factor: Any = None,
        train_len: int | None = None,
    ) -> None:
        """As :meth:`lssar.model.GPT.switch`. A RoPE scaling's ``auto`` factor is the evaluated
        length over the positions the model was pretrained for (``max_position_embeddings``):
        a converted model keeps its pretrained rotation, whatever length it was fine-tuned at."""
        scaling = RopeScaling.from_flags(rope_scaling, rope_factor)
        if scaling is not None and scaling.kind == "ntk":
            raise ValueError("--rope-scaling ntk has no transformers form; use yarn or linear")
        self.attn_spec = self.attn_spec.override(attn, p=attn_p)
        self._apply_attention()
        if scaling is not None:
            self.rope_scaling = scaling
            self._rope_len = None

    def _set_rope(self, seq_len: int) -> None:
        """Rebuild the rotary modules for ``seq_len`` tokens under :attr:`rope_scaling`."""
        trained = max_positions(self.model.config) or seq_len
        s = self.rope_scaling
        key = None if s is None else (s.scale(seq_len, trained) if s.factor is None else s.factor)
        if key == self._rope_len:
            return
        cfg = self.model.config
        if s is None or key == 1.0:
            cfg.rope_parameters = {"rope_type": "default", "rope_theta": self._theta}
        else:
            cfg.rope_parameters = hf_rope_parameters(RopeScaling(s.kind, key), trained, self._theta)
        for name, mod in list(self.model.named_modules()):
            if type(mod).__name__.endswith("RotaryEmbedding"):
                parent = self.model.get_submodule(name.rpartition(".")[0])
                setattr(parent, name.rpartition(".")[2], type(mod)(config=cfg))
        self._rope_len = key

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        reduction: str = "mean",
        window: int | None = None,
        weights: list | None = None,
        sink_tokens: int = 0,
    ) -> tuple[Tensor | None, Tensor | None]:
        """``idx (B, T)`` -> ``(logits (B, T, V) or None, loss)`` as :meth:`GPT.forward`: with
        ``targets`` and ``reduction="none"`` the loss is ``(B, T)`` and the logits are not kept
        (computed in chunks of :data:`LOGIT_CHUNK` positions). ``window``: every query sees its
        last ``window`` keys and, with ``sink_tokens``, the sequence's first ``sink_tokens``."""
        self._set_rope(idx.shape[1])
        cfg = self.model.config
        saved = getattr(cfg, "lssar_window", None), getattr(cfg, "lssar_sink_tokens", 0)
        cfg.lssar_window, cfg.lssar_sink_tokens = window, sink_tokens
        try:
            with hf.recording(weights):
                hidden = self.model.get_decoder()(input_ids=idx, use_cache=False)[0]  # (B, T, C)
        finally:
            cfg.lssar_window, cfg.lssar_sink_tokens = saved
        head = self.model.get_output_embeddings()
        if targets is None:
            return head(hidden).float(), None
        losses, logits = [], []
        for i in range(0, idx.shape[1], LOGIT_CHUNK):
            chunk = head(hidden[:, i : i + LOGIT_CHUNK]).float()  # (B, c, V)
            tgt = targets[:, i : i + LOGIT_CHUNK]
            losses.append(F.cross_entropy(chunk.transpose(1, 2), tgt, reduction="none"))
            if reduction != "none":
                logits.append(chunk)
        loss = torch.cat(losses, 1)  # (B, T)
        if reduction == "none":
            return None, loss
        return torch.cat(logits, 1), loss.mean()

    def double(self) -> HFCausalLM:  # numerical_health's float64 copy
        self.model.double()
        return self


def _rope_base(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"{type(config).__name__} has no rope_theta: not a RoPE model")
    return theta


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[HFCausalLM]:
    """``model`` wrapped for evaluation, in eval mode, under ``torch.inference_mode``."""
    was = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield HFCausalLM(model)
    finally:
        model.train(was)
