"""The language-model runs: what training writes and evaluation, export and lm-eval read.

A run is the directory ``out_dir/run_name`` in the format of :mod:`lssar.train.checkpoint`
(``config.json`` with the resolved config under ``"train"``, ``env.json``, ``log.jsonl``,
``ckpt/latest.pt`` / ``ckpt/final.pt``, ``DONE``). This module does not import the training
loop: readers of runs need only it and :mod:`lssar.train.config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lssar.model import GPT, GPTConfig
from lssar.train import fsdp
from lssar.train.checkpoint import CONFIG, FINAL, LATEST, check_config, load_checkpoint, load_state
from lssar.train.config import BOOKKEEPING, TrainConfig


def stored_train_config(run_dir: Path) -> dict[str, Any] | None:
    """The ``train`` table of ``run_dir/config.json``, or None if the run has not started."""
    path = Path(run_dir) / CONFIG
    return json.loads(path.read_text())["train"] if path.is_file() else None


def check_same_config(stored: dict[str, Any], cfg: TrainConfig, run_dir: Path) -> None:
    """Raise ``ValueError`` if ``cfg`` differs from the run's in anything but bookkeeping.

    A key the run's config lacks (a field added since, e.g. ``pos``) counts as its default,
    which is what that run did."""
    hint = "use a new --run_name, or --no-resume to start it over"
    check_config(stored, asdict(cfg), run_dir, hint, BOOKKEEPING, asdict(TrainConfig()))


def load_model_state(model: GPT, ckpt: dict[str, Any], path: Path) -> None:
    hint = "the config's model shape differs; use a new --run_name"
    load_state(model, ckpt["model"], path, "model", hint)


def load_run(
    run_dir: str | Path, map_location: Any = "cpu", which: str = "final"
) -> tuple[GPT, TrainConfig, dict[str, Any]]:
    """The model of a run (weights loaded, eval mode), its :class:`TrainConfig`, and metadata.

    ``which`` is ``"final"`` (finished runs) or ``"latest"`` (for an FSDP run, its sharded
    checkpoint, gathered in this process whatever the number of ranks that wrote it). Metadata:
    ``step``, ``tokens``, ``val_history`` (``[step, val_loss]`` pairs), ``data_dir``,
    ``tokenizer``, ``corpus``, ``run_dir``, ``checkpoint``.
    """
    if which not in ("final", "latest"):
        raise ValueError(f"which={which!r}: use 'final' or 'latest'")
    path = Path(run_dir) / {"final": FINAL, "latest": LATEST}[which]
    sharded = which == "latest" and (Path(run_dir) / fsdp.POINTER).is_file()
    if not path.is_file() and not sharded:
        unfinished = (Path(run_dir) / LATEST).is_file() or (Path(run_dir) / fsdp.POINTER).is_file()
        hint = (
            ": the run is not finished (resume it, or load which='latest')"
            if which == "final" and unfinished
            else ""
        )
        raise FileNotFoundError(f"{path} not found{hint}")
    if path.is_file():
        ckpt = load_checkpoint(path, map_location)
        model = GPT(GPTConfig(**ckpt["gpt_config"]))
        load_model_state(model, ckpt, path)
    else:
        ckpt = fsdp.pointer(run_dir)
        model = GPT(GPTConfig(**ckpt["gpt_config"]))
        fsdp.read_full(run_dir, ckpt, model)
        path = Path(run_dir) / ckpt["dir"]
    if isinstance(map_location, (str, torch.device)):
        model.to(map_location)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in ckpt["config"].items() if k in known})
    meta = {
        k: ckpt[k] for k in ("step", "tokens", "val_history", "data_dir", "tokenizer", "corpus")
    }
    return model.eval(), cfg, meta | {"run_dir": str(run_dir), "checkpoint": str(path)}
