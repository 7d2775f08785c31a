"""lssar-gpt for transformers, self-contained: torch and transformers only, no lssar.

``lssar export-hf RUN OUT`` copies this file into ``OUT`` and names it in ``config.json``'s
``auto_map``, so ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` loads the
model where lssar is not installed. It is the architecture of :class:`lssar.model.GPT` (token
embedding, pre-norm blocks of attention + MLP, tied head; RoPE with its exported scaling, ALiBi
or no positions), with the same parameter names, and an attention layer that dispatches through
``transformers.AttentionInterface`` as stock models do: the function registered under
``config._attn_implementation`` (lssar's fast kernels after ``lssar.integrations.hf.register()``,
under the variant's name), else the materialised reference below, which computes the variant
from its definition stored in ``config.lssar_variant`` (docs/method.md sections 3-4: a normaliser
``phi`` with an optional l1 normalisation and row scale, then re-weighting with power ``p``).
Its outputs equal lssar's GPT to float rounding (``tests/integrations/test_hf_gpt.py``).

Not here (lssar's own ``lssar.integrations.hf_gpt`` has them): packed sequences, sliding windows,
switching the attention rule after training.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # transformers >= 4.48
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:  # pragma: no cover - older transformers: the reference only
    ALL_ATTENTION_FUNCTIONS = {}

REWEIGHT_MIN_KEYS = 3  # rows with more visible keys than this are centred (O_i = 1)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
SCALINGS = {"linear": "linear", "ntk": "ntk", "dynamic": "dynamic-ntk", "yarn": "yarn"}


class LssarGPTConfig(PretrainedConfig):
    """The exported model's config (``config.json`` as ``lssar export-hf`` writes it)."""

    model_type = "lssar-gpt"
    attribute_map = {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "num_key_value_heads": "n_kv_head",
    }

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_kv_head: int | None = None,
        n_embd: int = 128,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        rope_base: float = 10000.0,
        pos: str = "rope",
        attn: str = "softmax",
        attn_options: dict[str, Any] | None = None,
        lssar_variant: dict[str, Any] | None = None,
        train_seq_len: int | None = None,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        rope_parameters: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size, self.n_layer, self.n_head = vocab_size, n_layer, n_head
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        self.n_embd, self.mlp_ratio, self.dropout = n_embd, mlp_ratio, dropout
        self.rope_base, self.pos, self.attn = rope_base, pos, attn
        self.attn_options = dict(attn_options or {})
        self.lssar_variant = lssar_variant
        self.train_seq_len, self.use_cache = train_seq_len, use_cache
        if rope_parameters is not None and rope_parameters.get("rope_type") != "default":
            self.rope_parameters = dict(rope_parameters)  # an exported scaling
            self.rope_theta, self.max_position_embeddings = rope_base, train_seq_len
        # lssar's registered attention functions read the variant's options from here
        kwargs.setdefault("lssar_options", dict(self.attn_options))
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# --------------------------------------------------------------------------------- positions


def _inv_freq(base: float, dim: int) -> Tensor:
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def rope_frequencies(config: LssarGPTConfig, head_dim: int, seq_len: int) -> tuple[Tensor, float]:
    """``(inv_freq (head_dim / 2,), attention factor)`` of the model's RoPE for an input whose
    largest position + 1 is ``seq_len``: the trained rotation, or its exported scaling (linear,
    NTK-aware, dynamic NTK, YaRN) from the training length ``train_seq_len``."""
    d, base = head_dim, config.rope_base
    trained = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    rp = getattr(config, "rope_parameters", None) or {}
    kind = SCALINGS.get(rp.get("rope_type", rp.get("type")))
    if kind is None:
        return trained, 1.0
    s, L = float(rp.get("factor", 1.0)), int(config.train_seq_len)
    if (seq_len <= L) if kind == "dynamic-ntk" else (s == 1.0):
        return trained, 1.0
    if kind == "linear":
        return (_inv_freq(base, d) / s).float(), 1.0
    if kind == "ntk":
        return _inv_freq(base * s ** (d / (d - 2)), d).float(), 1.0
    if kind == "dynamic-ntk":
        ratio = s * max(seq_len, L) / L - (s - 1)
        return _inv_freq(base * ratio ** (d / (d - 2)), d).float(), 1.0

    def pair(rotations: float) -> float:
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair(YARN_BETA_FAST)), 0)
    high = min(math.ceil(pair(YARN_BETA_SLOW)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    ext = _inv_freq(base, d)
    inv = ext / s * ramp + ext * (1 - ramp)
    return inv.float(), (0.1 * math.log(s) + 1.0 if s > 1 else 1.0)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs of ``x (B, H, T, D)`` (half-split layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def alibi_slopes(n_head: int) -> Tensor:
    """ALiBi's per-head slopes (Press et al.'s rule for any number of heads)."""

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** math.floor(math.log2(n_head))
    return torch.tensor(power_of_2(c) + power_of_2(2 * c)[0::2][: n_head - c])


# ---------------------------------------------------------------------------------- attention


def _unit(x: Tensor) -> Tensor:
    big = x.detach().abs().amax(-1, keepdim=True)
    y = x / torch.where((big > 0) & torch.isfinite(big), big, torch.ones_like(big))
    norm = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    ok = norm > 0
    return torch.where(ok, y / torch.where(ok, norm, torch.ones_like(norm)), torch.zeros_like(y))


def _log_phi(s: Tensor, phi: str) -> Tensor:
    if phi == "sigmoid":
        return F.logsigmoid(s)
    return torch.where(s < -30.0, s, torch.log(F.softplus(s.clamp_min(-30.0))))


def variant_weights(
    q: Tensor,
    k: Tensor,
    mask: Tensor,
    variant: dict[str, Any],
    s_h: Tensor | None = None,
    alibi: Tensor | None = None,
) -> Tensor:
    """The attention weights ``(B, H, T_q, T_k)`` of ``q (B, H, T_q, D)``, ``k (B, H, T_k, D)``
    under the boolean ``mask (B|1, 1|H, T_q, T_k)`` (True = may attend; it holds causality), by
    the variant's definition (``config.lssar_variant``): scores ``c_i q.k`` (q, k unit vectors
    with ``qk_norm``), ``c_i`` = 1/sqrt(d), ln d ln N_i (``log_n``), s_h ln N_i / sqrt(d)
    (``ssmax``) or ln d ln n (``const``, times s_h if learned); ``phi``; l1; re-weighting."""
    d = q.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(dtype), k.to(dtype)
    opts = variant["options"]
    n = mask.sum(-1, keepdim=True, dtype=dtype)  # N_i
    if variant["qk_norm"]:
        q, k = _unit(q), _unit(k)
    s = q @ k.transpose(-1, -2)
    scaling = variant["scaling"]
    if scaling == "log_n":
        s = s * (math.log(opts.get("scale_dim") or d) * torch.log(n.clamp_min(1.0)))
    elif scaling == "const":
        c = math.log(d) * math.log(opts["n"])
        s = s * (c if s_h is None else s_h.to(dtype).reshape(-1, 1, 1) * c)
    elif scaling == "ssmax":
        s = s * (s_h.to(dtype).reshape(-1, 1, 1) * torch.log(n.clamp_min(1.0)) / math.sqrt(d))
    else:
        s = s / math.sqrt(d)
    if alibi is not None:
        t_q, t_k = q.shape[-2], k.shape[-2]
        i = torch.arange(t_q, device=q.device, dtype=dtype) + t_k - t_q
        j = torch.arange(t_k, device=q.device, dtype=dtype)
        s = s - alibi.to(dtype).reshape(1, -1, 1, 1) * (i[:, None] - j[None, :]).abs()
    phi, l1 = variant["phi"], variant["l1"]
    visible = mask.expand_as(s)
    if phi == "exp":
        s = s.masked_fill(~visible, float("-inf"))
        m = s.amax(-1, keepdim=True)
        a = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    elif phi in ("softplus", "sigmoid"):
        if phi == "sigmoid":
            bias = opts.get("bias")
            s = s + (-torch.log(n.clamp_min(1.0)) if bias is None else bias)
        if l1:
            ls = _log_phi(s, phi).masked_fill(~visible, float("-inf"))
            m = ls.amax(-1, keepdim=True)
            a = torch.exp(ls - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        else:
            a = torch.sigmoid(s) if phi == "sigmoid" else F.softplus(s)
    else:  # relu
        a = F.relu(s)
    a = torch.where(visible, a, torch.zeros_like(a))
    if variant["divide_by_n"]:
        a = a / n.clamp_min(1.0)
    if not l1:
        return a
    z = a.sum(-1, keepdim=True)
    w = a / torch.where(z > 0, z, torch.ones_like(z))
    p = opts.get("p")
    if p is None:
        return w
    offset = (n > REWEIGHT_MIN_KEYS).to(dtype)  # O_i
    x = F.relu(n * w - offset)
    x_max = x.amax(-1, keepdim=True)
    has_mass = x_max > 64.0 * torch.finfo(dtype).eps * offset
    r = x / torch.where(has_mass, x_max, torch.ones_like(x_max))
    pos = r > 0
    y = torch.where(pos, torch.where(pos, r, torch.ones_like(r)) ** p, torch.zeros_like(r))
    sharp = y / torch.where(has_mass, y.sum(-1, keepdim=True), torch.ones_like(x_max))
    return torch.where(has_mass, sharp, w)


def reference_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """The ``AttentionInterface`` signature: ``(B, H, T_q, D)`` query, ``(B, H_kv, T_k, D)``
    key and value, a boolean mask or None (causal, bottom-right) -> ``((B, T_q, H, D), weights)``.
    The variant is the module's (``module.variant``, ``module.ssmax_s``, ``module.alibi``)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    t_q, t_k = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        i = torch.arange(t_q, device=query.device)[:, None] + t_k - t_q
        attention_mask = (torch.arange(t_k, device=query.device)[None, :] <= i)[None, None]
    w = variant_weights(query, key, attention_mask, module.variant, module.ssmax_s, module.alibi)
    if dropout > 0:
        w = F.dropout(w, dropout, training=True)
    out = (w @ value.to(w.dtype)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), w


class Attention(nn.Module):
    """``x (B, T, C) -> (B, T, C)``: q/k/v, positions, the attention by name, the output."""

    def __init__(self, config: LssarGPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.n_head, self.n_kv = config.n_head, config.n_kv_head or config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.qkv = nn.Linear(
            config.n_embd, (self.n_head + 2 * self.n_kv) * self.head_dim, bias=False
        )
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.variant = config.lssar_variant
        learned = "s" in self.variant["options"]
        self.ssmax_s = nn.Parameter(torch.ones(self.n_head)) if learned else None
        self.alibi = None  # set per call for ALiBi models (slopes on the input's device)
        self.is_causal = True

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        alibi: Tensor | None,
        attention_mask: Tensor | None,
        cache: Any,
    ) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim],
            dim=-1,
        )
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        self.alibi = alibi
        fn = self._attention_function()
        dropout = self.config.dropout if self.training else 0.0
        y, _ = fn(self, q, k, v, attention_mask, dropout=dropout, scaling=None)
        return self.proj(y.reshape(b, t, c))

    def _attention_function(self) -> Any:
        """The function ``config._attn_implementation`` names, as stock models look it up.

        The model always computes its trained variant; the name picks the kernel: the default
        (``eager``) or the variant's own name is the function registered under that name
        (lssar's, after ``lssar.integrations.hf.register()``) or else the reference here; a
        plain softmax model also runs transformers' own (``sdpa``, ``flash_attention_2``, ...).
        The reference takes over where a registered function cannot express the model: ALiBi,
        a learned per-head scale."""
        name, trained = self.config._attn_implementation, self.config.attn
        v = self.variant
        plain = (v["phi"], v["scaling"], v["qk_norm"], v["options"].get("p")) == (
            "exp",
            "sdpa",
            False,
            None,
        )
        if name in (None, "eager"):
            name = trained
        elif name != trained and not plain:
            raise ValueError(
                f"attn_implementation={name!r}: this model computes {trained!r}; use the default "
                f"or {trained!r} (lssar's kernels once lssar.integrations.hf.register() ran)"
            )
        own = self.alibi is not None or self.ssmax_s is not None
        if name in ALL_ATTENTION_FUNCTIONS and not own:
            return ALL_ATTENTION_FUNCTIONS[name]
        if name != trained:
            raise ValueError(f"attn_implementation={name!r} is not registered in transformers")
        return reference_attention_forward


class Block(nn.Module):
    def __init__(self, config: LssarGPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = Attention(config, layer_idx)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=False)
        hidden = int(config.mlp_ratio * config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, hidden, bias=False),
            nn.GELU(),
            nn.Linear(hidden, config.n_embd, bias=False),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor, *attn: Any) -> Tensor:
        x = x + self.attn(self.ln1(x), *attn)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The trunk, with lssar.model.GPT's parameter names (``wte``, ``blocks``, ``ln_f``,
    ``head``)."""

    def __init__(self, config: LssarGPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight


class LssarGPTForCausalLM(PreTrainedModel, GenerationMixin):
    """``input_ids (B, T)`` -> logits; a 2D ``attention_mask`` (1 = token, 0 = padding; RoPE
    positions counted over real tokens), HF's ``DynamicCache``, ``labels`` shifted inside."""

    config_class = LssarGPTConfig
    base_model_prefix = "gpt"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_attention_backend = True
    _tied_weights_keys = {"gpt.head.weight": "gpt.wte.weight"}

    def __init__(self, config: LssarGPTConfig) -> None:
        super().__init__(config)
        if not config.lssar_variant:
            raise ValueError("config.json has no lssar_variant: export the run again")
        self.gpt = GPT(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Every weight comes from the checkpoint."""

    def get_input_embeddings(self) -> nn.Module:
        return self.gpt.wte

    def get_output_embeddings(self) -> nn.Module:
        return self.gpt.head

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        from transformers import DynamicCache

        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        h = self.gpt.wte(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = h.shape
        past = cache.get_seq_length() if cache is not None else 0
        mask = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            real = attention_mask.bool()  # (B, past + T)
            if position_ids is None:
                position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            i = torch.arange(t, device=h.device)[:, None] + past
            causal = torch.arange(past + t, device=h.device)[None, :] <= i
            mask = causal[None, None] & real[:, None, None, :]  # (B, 1, T, past + T)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=h.device)[None]
        rope = alibi = None
        cfg = self.config
        if cfg.pos == "rope":
            head_dim = cfg.n_embd // cfg.n_head
            seq_len = int(position_ids.max()) + 1 if position_ids.numel() else 0
            inv, factor = rope_frequencies(cfg, head_dim, seq_len)
            ang = position_ids.float()[..., None] * inv.to(h.device)  # (B|1, T, D/2)
            rope = ((ang.cos() * factor)[:, None], (ang.sin() * factor)[:, None])
        elif cfg.pos == "alibi":
            alibi = alibi_slopes(cfg.n_head).to(h.device)
        h = self.gpt.drop(h)
        for block in self.gpt.blocks:
            h = block(h, rope, alibi, mask, cache)
        h = self.gpt.ln_f(h)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.gpt.head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        fields = CausalLMOutputWithPast.__dataclass_fields__
        key = "cache" if "cache" in fields else "past_key_values"
        out = CausalLMOutputWithPast(
            loss=loss, logits=logits, **{key: cache if use_cache else None}
        )
        return out if return_dict is not False else out.to_tuple()
