"""Run directories and checkpoints: what training writes and evaluation, export and lm-eval read.

A run is the directory ``out_dir/run_name``: ``config.json`` (resolved config), ``env.json``
(code version, versions, hardware), ``log.jsonl`` (one JSON per train/eval event), atomic
checkpoints ``ckpt/latest.pt`` / ``ckpt/final.pt`` and a ``DONE`` marker. Every file is written
with :func:`lssar.runio.atomic_write`, so a run killed at any moment resumes from whole files.
This module does not import the training loop: readers of runs need only it and
:mod:`lssar.train.config`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lssar.model import GPT, GPTConfig
from lssar.runio import atomic_write, disk_full, load_data, no_space, one_line
from lssar.train import fsdp
from lssar.train.config import BOOKKEEPING, TrainConfig

CKPT_FORMAT = "lssar-ckpt"


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


# --------------------------------------------------------------------------------- the run dir


def stored_train_config(run_dir: Path) -> dict[str, Any] | None:
    """The ``train`` table of ``run_dir/config.json``, or None if the run has not started."""
    path = Path(run_dir) / "config.json"
    return json.loads(path.read_text())["train"] if path.is_file() else None


def check_same_config(stored: dict[str, Any], cfg: TrainConfig, run_dir: Path) -> None:
    """Raise ``ValueError`` if ``cfg`` differs from the run's in anything but bookkeeping.

    A key the run's config lacks (a field added since, e.g. ``pos``) counts as its default,
    which is what that run did."""
    now, defaults = asdict(cfg), asdict(TrainConfig())
    diff = [
        f"{k}: {stored.get(k, defaults[k])!r} (run) != {v!r} (now)"
        for k, v in now.items()
        if k not in BOOKKEEPING and stored.get(k, defaults[k]) != v
    ]
    if diff:
        raise ValueError(
            f"{run_dir} was started with a different config ({'; '.join(diff)}): use a new "
            "--run_name, or --no-resume to start it over"
        )


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/log.jsonl`` (none if it does not exist).

    A torn last line (a run killed, or a disk that filled, in the middle of appending it) is
    dropped with a warning naming the file; a damaged line before it is a ``ValueError`` naming
    the file and the line.
    """
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()  # the newline that ends the last record
    records = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a record with an integer step")
        except (ValueError, UnicodeDecodeError) as e:
            if i == len(lines):
                print(f"warning: {path}: dropped a torn last line ({one_line(e, 80)})")
                break
            raise ValueError(
                f"{path} line {i} is damaged ({one_line(e, 80)}): delete that line, or start "
                "the run over with --no-resume"
            ) from None
        records.append(rec)
    return records


def init_run_dir(run_dir: Path, step: int, config: dict[str, Any], env: dict[str, Any]) -> None:
    """Write config/env; keep the log up to ``step`` (the curve continues, no duplicates).

    Call it holding the run's lock (:func:`lssar.runio.exclusive_lock`).
    """
    (run_dir / "ckpt").mkdir(parents=True, exist_ok=True)
    if step == 0:  # a fresh start: nothing of an earlier attempt may be resumed later
        for stale in ("ckpt/latest.pt", "ckpt/final.pt", "DONE"):
            (run_dir / stale).unlink(missing_ok=True)
    kept = [r for r in read_log(run_dir) if r["step"] <= step] if step > 0 else []
    text = "".join(json.dumps(r) + "\n" for r in kept)
    atomic_write(run_dir / "log.jsonl", lambda f: f.write(text.encode()))
    write_json(run_dir / "config.json", config)
    write_json(run_dir / "env.json", env | {"start_step": step})


def append_log(run_dir: Path, record: dict[str, Any]) -> None:
    """Append one record (one ``write``: a kill leaves at most a torn last line, which
    :func:`read_log` drops)."""
    path = Path(run_dir) / "log.jsonl"
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        if no_space(e):
            raise disk_full(path) from e
        raise


def finish_run(run_dir: Path, step: int, tokens: int, val_loss: float) -> None:
    """``ckpt/final.pt`` (the last ``latest.pt``) and the ``DONE`` marker."""
    latest = Path(run_dir) / "ckpt" / "latest.pt"
    final = latest.with_name("final.pt")
    final.unlink(missing_ok=True)
    try:  # final.pt is the last latest.pt: a hard link saves writing it twice
        os.link(latest, final)
    except OSError:
        with open(latest, "rb") as src:
            atomic_write(final, lambda f: shutil.copyfileobj(src, f))
    write_json(Path(run_dir) / "DONE", {"step": step, "tokens": tokens, "val_loss": val_loss})


# ------------------------------------------------------------------------------- checkpoints

# (resolved path, size, mtime_ns, inode) -> sha256: a checkpoint is hashed once per process
_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file (a checkpoint), remembered while its size and mtime are unchanged."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def save_checkpoint(path: Path, **state: Any) -> None:
    """Write ``state`` (model/optimizer state dicts, counters, configs) atomically to ``path``."""
    atomic_write(path, lambda f: torch.save({"format": CKPT_FORMAT, **state}, f))


def load_checkpoint(path: Path, map_location: Any) -> dict[str, Any]:
    try:
        ckpt = load_data(path, map_location)
    except ValueError as e:
        raise ValueError(f"checkpoint {path} is corrupt ({e}): delete it or start a new run") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise ValueError(
            f"checkpoint {path} is not an lssar checkpoint: delete it or start a new run"
        )
    return ckpt


def load_model_state(model: GPT, ckpt: dict[str, Any], path: Path) -> None:
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise ValueError(
            f"checkpoint {path} does not fit this model ({one_line(e)}): the "
            "config's model shape differs; use a new --run_name"
        ) from e


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
    path = Path(run_dir) / "ckpt" / f"{which}.pt"
    sharded = which == "latest" and (Path(run_dir) / fsdp.POINTER).is_file()
    if not path.is_file() and not sharded:
        unfinished = any((path.parent / n).exists() for n in ("latest.pt", "latest.json"))
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
