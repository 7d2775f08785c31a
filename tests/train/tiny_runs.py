"""A tiny training config, the command that trains on 2 CPU ranks and a run's log: shared by the
tests of lssar.train."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lssar.train.config import TrainConfig, load_config

TINY = dict(
    n_layer=2,
    n_head=2,
    n_embd=32,
    seq_len=32,
    batch_size=4,
    eval_tokens=256,
    warmup_steps=2,
    lr=1e-2,
    min_lr=1e-3,
    dtype="fp32",
    log_every=1,
    eval_every=4,
    ckpt_every=100,
)


def tiny(data_dir: Path, out_dir: Path, **kw) -> TrainConfig:
    over = TINY | {"data_dir": str(data_dir), "out_dir": str(out_dir), "max_steps": 8} | kw
    return load_config(None, over)


# `lssar train` on 2 CPU processes (gloo), as a user starts it
TRAIN_ON_2_RANKS = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
TRAIN_ON_2_RANKS += ["--nproc_per_node=2", "-m", "lssar", "train"]


def log_of(run: Path, event: str = "train") -> list[dict]:
    lines = (run / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]
