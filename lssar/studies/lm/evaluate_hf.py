"""``lssar eval MODEL_DIR``: the project's length protocol on any Hugging Face causal LM directory
(a pretrained model, or one converted by ``lssar finetune``), through the same measurements as
the GPT runs (:mod:`lssar.studies.lm.context`, on :class:`lssar.integrations.hf_lm.HFCausalLM`).

It scores long held-out documents of a dataset tokenised with the model's own tokenizer (``lssar
data prepare --tokenizer hf:MODEL_DIR``): the loss at every length from one forward per document,
the loss by position, the copy probe, optionally with a sliding window (``--window L``: the
model's own L-key window, the locality control) or a RoPE scaling (``--rope-scaling yarn``:
factor = the evaluated length over the model's pretrained positions). Results are cached by the
model's weights, the data, the settings and the evaluation code.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lssar import data
from lssar.data.manifest import manifest_files
from lssar.integrations.finetune import autocast
from lssar.integrations.hf_lm import evaluating
from lssar.integrations.pretrained import load_model
from lssar.runio import atomic_write, environment
from lssar.studies.common import code_digest
from lssar.studies.lm.context import copy_probe, long_documents, loss_in_documents
from lssar.train.checkpoint import file_sha256

_SOURCES = ("studies/lm/context.py", "studies/lm/evaluate_hf.py", "integrations", "ops")


def tag_of(window: int | None, rope: str | None, lengths: list[int], sinks: int = 0) -> str:
    w = "full" if window is None else f"window{window}" + (f"+{sinks}sinks" if sinks else "")
    parts = [w] + ([rope] if rope else [])
    return "_".join(parts + [f"to{max(lengths)}"])


def evaluate_model(
    model_dir: str | Path,
    dataset: str | Path,
    lengths: list[int],
    documents: int,
    window: int | None = None,
    rope: str | None = None,
    copy_distances: list[int] = (),
    copy_probes: int = 8,
    dtype: str = "auto",
    cache: str | Path | None = None,
    progress: bool = True,
    sink_tokens: int = 0,
) -> dict[str, Any]:
    """Evaluate the model directory ``model_dir`` (the attention its ``lssar.json`` records, or
    its own) on ``documents`` held-out documents of ``dataset`` at ``lengths`` (tokens), with the
    copy probe at ``copy_distances``; cached as ``cache/<tag>.json`` (default
    ``model_dir/eval``) while the weights, data, settings and code are unchanged. With
    ``window``, ``sink_tokens`` first keys of each document stay visible too (attention sinks:
    a pretrained model's queries lean on the sequence's first tokens)."""
    model_dir, dataset = Path(model_dir), Path(dataset)
    if window is not None and window < 1:
        raise ValueError(f"--window must be a positive number of keys, got {window}")
    if sink_tokens and window is None:
        raise ValueError("--sink-tokens keeps the first keys beside a window: give --window too")
    if sink_tokens < 0:
        raise ValueError(f"--sink-tokens must be >= 0, got {sink_tokens}")
    settings = {"lengths": sorted(lengths), "documents": documents, "window": window,
                "rope": rope, "copy": list(copy_distances), "copy_probes": copy_probes,
                "dtype": dtype, "sink_tokens": sink_tokens}  # fmt: skip
    key = json.loads(json.dumps({
        "weights": file_sha256(model_dir / "model.safetensors"),
        "data": manifest_files(data.read_manifest(dataset)),
        "settings": settings,
        "code": code_digest(_SOURCES),
    }))  # fmt: skip
    path = Path(cache or model_dir / "eval") / f"{tag_of(window, rope, lengths, sink_tokens)}.json"
    if path.is_file():
        try:
            prev = json.loads(path.read_text())
        except ValueError:  # a damaged cache entry is recomputed
            prev = {}
        if prev.get("key") == key:
            return prev
    model, source = load_model(model_dir)
    val = data.load_split(dataset, "val")
    docs = long_documents(val, data.read_manifest(dataset)["eot"], max(lengths), documents)
    result: dict[str, Any] = {"key": key, "model": str(model_dir), "source": source, **settings}
    with evaluating(model) as lm, autocast(dtype):
        if rope:
            lm.switch(rope_scaling=rope)
        result["evaluated_attention"] = lm.attn_spec.label
        sinks = {"window": window, "sink_tokens": sink_tokens, "progress": progress}
        result |= loss_in_documents(lm, docs, sorted(lengths), **sinks)
        if copy_distances:
            result["copy"] = copy_probe(lm, val, list(copy_distances), copy_probes, **sinks)
    result["eval_env"] = environment("cpu")
    atomic_write(path, json.dumps(result, indent=1))
    return result


def is_model_dir(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (not an ``lssar train`` run)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    return "model_type" in json.loads(cfg.read_text())


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# {r['model']}: {r['evaluated_attention']}"
        + ("" if r["window"] is None else f", window {r['window']}")
        + (f" + {r['sink_tokens']} sinks" if r.get("sink_tokens") else "")
        + ("" if not r["rope"] else f", {r['rope']} scaling"),
        "",
        f"{r['documents']} held-out documents; loss over the first T tokens of each.",
        "",
        "| T | tokens | loss | loss of positions (T/2, T] |",
        "|---|---|---|---|",
    ]
    for t, v in r["loss"].items():
        n = r["tokens_per_length"][t]
        lines.append(f"| {t} | {n} | {v:.4f} | {r['loss_band'][t]:.4f} |")
    if "copy" in r:
        c = r["copy"]
        lines += ["", "| copy distance | second copy | first copy |", "|---|---|---|"]
        lines += [f"| {d} | {c['second'][d]:.4f} | {c['first'][d]:.4f} |" for d in c["second"]]
    return "\n".join(lines) + "\n"


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lssar eval MODEL_DIR", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("model", help="a Hugging Face model directory (lssar convert / finetune)")
    ap.add_argument(
        "--data",
        help="a dataset tokenised with hf:MODEL_DIR (default: the one a model made by lssar "
        "finetune was trained on)",
    )
    ap.add_argument("--lengths", default="256,1024,4096", help="tokens, e.g. 256,1024,4096")
    ap.add_argument("--documents", type=int, default=8, help="held-out documents scored")
    ap.add_argument("--window", type=int, help="every query sees only its last WINDOW keys")
    ap.add_argument(
        "--sink-tokens",
        type=int,
        default=0,
        help="with --window: the document's first N tokens stay visible too (attention sinks)",
    )
    ap.add_argument("--rope-scaling", help="linear, dynamic-ntk or yarn (auto factor)")
    ap.add_argument("--copy", default="", help="copy-probe distances in tokens, e.g. 512,2048")
    ap.add_argument("--copy-probes", type=int, default=8)
    ap.add_argument("--dtype", default="auto", help="autocast: auto, bf16, fp32")
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
        copy = [int(x) for x in a.copy.split(",")] if a.copy else []
    except ValueError:
        raise ValueError("--lengths and --copy take comma-separated token counts") from None
    dataset = a.data or (
        json.loads(rec.read_text()).get("dataset")
        if (rec := Path(a.model) / "lssar.json").is_file()
        else None
    )
    if dataset is None:
        raise ValueError(
            f"{a.model}: give --data (a dataset prepared with `lssar data prepare --tokenizer "
            f"hf:{a.model}`)"
        )
    r = evaluate_model(a.model, dataset, lengths, a.documents, a.window, a.rope_scaling, copy,
                       a.copy_probes, a.dtype, sink_tokens=a.sink_tokens)  # fmt: skip
    print(markdown(r))
    return 0
