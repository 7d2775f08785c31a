"""Arms, presets, training, evaluation and the tidy rows of the recall study.

The model is :class:`lssar.recall.model.RecallModel` (a GPT with a token shift; see that module
for why). Every trained arm shares the task, model size, steps, learning-rate schedule and the
training batches of a seed (batch ``k`` of seed ``s`` is ``task.batch((s, k), ...)``); only the
attention differs. Every arm is scored on the same evaluation sequences. Training is fp32 (the
CPUs this runs on have no native bf16). A run lives in ``RUNS/<arm>-s<seed>-<config hash>/``:
``ckpt.pt`` (atomic, every ``ckpt_every`` steps) while it trains, ``model.pt`` + ``done.json``
once finished, and one ``eval-*.json`` per evaluation rule; finished runs and evaluations are
reused, unfinished runs resume from their checkpoint, and a changed setting gets a new hash
(never a stale reuse). With ``jobs > 1`` the (seed, model) units train and evaluate in that many
worker processes of one thread each (tiny models use one core far better than two threads do);
the results do not depend on ``jobs``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import math
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lssar.model import GPTConfig
from lssar.recall.model import RecallModel, window_mask
from lssar.recall.task import IGNORE, RecallTask
from lssar.runio import atomic_write, environment

EVAL_SEED = 1_000_003  # evaluation sequences: task.batch((EVAL_SEED, multiple, chunk), ...)


@dataclass(frozen=True)
class Arm:
    """A trained model (``train_attn``/``train_p``, optional sliding window of ``train_len``)
    and the eval-only re-weighting sweep applied to it (``eval_ps``: lssar with that p)."""

    name: str
    train_attn: str
    train_p: float | None = None
    window: bool = False
    eval_ps: tuple[float, ...] = ()


EVAL_PS = (1.0, 2.0, 3.0, 5.0, 8.0, 15.0)
ARMS: dict[str, Arm] = {
    a.name: a
    for a in [
        Arm("softmax", "softmax"),
        Arm("softmax-qknorm-logn", "softmax-qknorm-logn"),
        Arm("ssmax", "ssmax"),
        Arm("lssa", "lssa", eval_ps=EVAL_PS),
        Arm("lssar p=15", "lssar", 15.0),
        Arm("lssar p=3", "lssar", 3.0),
        Arm("window", "softmax", window=True),
    ]
}


def eval_label(arm: Arm, p: float | None) -> str:
    """Row label: the arm, or ``lssa -> lssar p=X (eval)`` for an eval-only re-weighting."""
    return arm.name if p is None else f"{arm.name} -> lssar p={p:g} (eval)"


@dataclass(frozen=True)
class StudyConfig:
    """Everything a study depends on (the task, the model, the optimisation, the evaluation)."""

    # L = 32, 6 pairs, 4 queries (n > m: with n = m the last query is answerable by elimination),
    # 16 keys, 16 values, 8 fillers; the pilot (PILOT.md) sized the model and the steps
    task: RecallTask = field(
        default_factory=lambda: RecallTask(
            train_len=32, n_pairs=6, n_queries=4, n_keys=16, n_values=16, n_filler=8
        )
    )
    arms: tuple[str, ...] = ("softmax", "lssa", "lssar p=15", "window")
    seeds: tuple[int, ...] = (0,)
    multiples: tuple[int, ...] = (1, 2, 4, 8, 16)
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    token_shift: bool = True  # see lssar/recall/model.py: without it softmax never learned
    steps: int = 1500
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    eval_seqs: int = 100  # per length: >= 200 queries per bucket when n_queries = 4
    eval_batch: int = 20
    eval_ps: tuple[float, ...] | None = None  # None = each arm's own sweep
    ckpt_every: int = 100
    jobs: int = 1  # worker processes (one thread each); does not change any result

    def __post_init__(self) -> None:
        for a in self.arms:
            if a not in ARMS:
                raise ValueError(f"unknown arm {a!r}; arms: {', '.join(ARMS)}")
        if not self.arms:
            raise ValueError("arms: need at least one arm")
        if not self.seeds:
            raise ValueError("seeds: need at least one seed")
        for m in self.multiples:
            if not isinstance(m, int) or m < 1:
                raise ValueError(f"multiples: {m!r} is not a positive integer")
        for name in (
            "n_layer",
            "n_head",
            "n_embd",
            "steps",
            "batch_size",
            "eval_seqs",
            "eval_batch",
            "ckpt_every",
            "jobs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be positive")

    def train_dict(self) -> dict[str, Any]:
        """The settings a trained model depends on (hashed into the run name)."""
        d = dataclasses.asdict(self)
        for k in (
            "arms",
            "seeds",
            "multiples",
            "eval_seqs",
            "eval_batch",
            "eval_ps",
            "ckpt_every",
            "jobs",
        ):
            d.pop(k)
        return d


@dataclass(frozen=True)
class Preset:
    description: str
    config: StudyConfig
    budget: str


PRESETS = {
    "quick": Preset(
        "softmax, lssa (+ eval-time re-weighting sweep), lssar p=15 and the window control; 1 seed",
        StudyConfig(jobs=2),
        "<= 10 min on 2 CPU cores",
    ),
    "cpu": Preset(
        "every arm, 5 seeds",
        StudyConfig(arms=tuple(ARMS), seeds=(0, 1, 2, 3, 4), jobs=2),
        "<= 75 min on 2 CPU cores",
    ),
}


def preset_config(name: str, **overrides: Any) -> StudyConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name].config, **overrides)


# ------------------------------------------------------------------------------- training


def run_dir(runs: Path, cfg: StudyConfig, arm: Arm, seed: int) -> Path:
    """The run of ``arm``/``seed``. A window of ``train_len`` at the training length is the
    whole causal context, so the window arm *trains* exactly as softmax: it shares softmax's run
    (one model) and differs only at evaluation, where the window hides keys >= L back."""
    d = cfg.train_dict() | {"attn": arm.train_attn, "p": arm.train_p}
    h = hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]
    name = f"{arm.train_attn}" + ("" if arm.train_p is None else f"-p{arm.train_p:g}")
    return runs / f"{name}-s{seed}-{h}"


def build_model(cfg: StudyConfig, arm: Arm) -> RecallModel:
    opts = {} if arm.train_p is None else {"p": arm.train_p}
    return RecallModel(
        GPTConfig(
            vocab_size=cfg.task.vocab_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            attn=arm.train_attn,
            attn_options=opts,
        ),
        token_shift=cfg.token_shift,
    )


def _lr(cfg: StudyConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _save(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def train_arm(
    cfg: StudyConfig,
    arm: Arm,
    seed: int,
    runs: Path,
    progress: bool = True,
    stop_after: int | None = None,
) -> tuple[RecallModel, dict[str, Any]]:
    """Train (or reuse, or resume) one arm/seed; returns the model and its ``done.json``.

    ``stop_after`` stops (with a checkpoint) after that many steps of this call: for tests of
    resume, and to spread a long preset over several invocations.
    """
    rd = run_dir(runs, cfg, arm, seed)
    model = build_model(cfg, arm)
    if (rd / "done.json").exists() and (rd / "model.pt").exists():
        model.load_state_dict(torch.load(rd / "model.pt", weights_only=True))
        return model.eval(), json.loads((rd / "done.json").read_text())
    torch.manual_seed(seed)
    model = build_model(cfg, arm)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    start, log, elapsed = 0, [], 0.0
    if (rd / "ckpt.pt").exists():
        ck = torch.load(rd / "ckpt.pt", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start, log, elapsed = ck["step"], ck["log"], ck["elapsed"]
    L = cfg.task.train_len
    mask = window_mask(L, L) if arm.window else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{arm.name} s{seed}", leave=False)
    t0, done_here, acc_sum, loss_sum, n = time.time(), 0, 0.0, 0.0, 0
    model.train()
    for step in range(start, cfg.steps):
        b = cfg.task.batch((seed, step), L, cfg.batch_size)
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        logits, _ = model(b["tokens"], attn_mask=mask)
        tgt = b["targets"]
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            sel = tgt != IGNORE
            acc_sum += (logits.argmax(-1)[sel] == tgt[sel]).float().mean().item()
            loss_sum += loss.item()
            n += 1
        if (step + 1) % 50 == 0 or step + 1 == cfg.steps:
            log.append({"step": step + 1, "loss": loss_sum / n, "acc": acc_sum / n})
            acc_sum = loss_sum = 0.0
            n = 0
            if bar is not None:
                bar.set_postfix(loss=f"{log[-1]['loss']:.3f}", acc=f"{log[-1]['acc']:.2f}")
        if bar is not None:
            bar.update(1)
        done_here += 1
        last = step + 1 == cfg.steps
        stop = stop_after is not None and done_here >= stop_after and not last
        if (step + 1) % cfg.ckpt_every == 0 or stop:
            _save(
                rd / "ckpt.pt",
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step + 1,
                    "log": log,
                    "elapsed": elapsed + time.time() - t0,
                },
            )
        if stop:
            if bar is not None:
                bar.close()
            return model.eval(), {"finished": False, "step": step + 1}
    if bar is not None:
        bar.close()
    _save(rd / "model.pt", model.state_dict())
    done = {
        "finished": True,
        "arm": arm.name,
        "seed": seed,
        "steps": cfg.steps,
        "train_seconds": elapsed + time.time() - t0,
        "log": log,
        "config": cfg.train_dict() | {"attn": arm.train_attn, "p": arm.train_p},
        "env": environment("cpu"),
    }
    atomic_write(rd / "done.json", json.dumps(done, indent=1, default=str))
    (rd / "ckpt.pt").unlink(missing_ok=True)
    return model.eval(), done


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_arm(
    model: RecallModel, cfg: StudyConfig, arm: Arm, p: float | None, rd: Path
) -> dict[str, dict[str, list[int]]]:
    """Per length multiple: ``correct`` (0/1) and ``distance`` of every scored query; cached in
    ``rd/eval-<rule>.json``. ``p`` set = evaluate with lssar at that p (eval-only re-weighting)."""
    rule = ("window-sink" if arm.window else "trained") if p is None else f"lssar-p{p:g}"
    path = rd / f"eval-{rule}-{cfg.eval_seqs}.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if p is None:
        model.set_attention(arm.train_attn, {} if arm.train_p is None else {"p": arm.train_p})
    else:
        model.set_attention("lssar", {"p": p})
    model.eval()
    L = cfg.task.train_len
    changed = False
    for m in cfg.multiples:
        if str(m) in cached:
            continue
        T = m * L
        mask = window_mask(T, L) if arm.window else None
        correct, dist = [], []
        for c in range(0, cfg.eval_seqs, cfg.eval_batch):
            size = min(cfg.eval_batch, cfg.eval_seqs - c)
            b = cfg.task.batch((EVAL_SEED, m, c), T, size)
            logits, _ = model(b["tokens"], attn_mask=mask)
            qp = b["query_pos"]
            pred = logits.gather(1, qp[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
            correct += (pred == b["answer"]).flatten().int().tolist()
            dist += b["distance"].flatten().tolist()
        cached[str(m)] = {"correct": correct, "distance": dist}
        changed = True
    if changed:
        atomic_write(path, json.dumps(cached))
    model.set_attention(arm.train_attn, {} if arm.train_p is None else {"p": arm.train_p})
    return cached


def tidy_rows(
    arm: Arm, p: float | None, seed: int, ev: dict[str, dict[str, list[int]]], train_len: int
) -> list[dict[str, Any]]:
    """One row per (length multiple, distance bucket); empty buckets are left out."""
    rows = []
    for m, d in sorted(ev.items(), key=lambda kv: int(kv[0])):
        correct, dist = d["correct"], d["distance"]
        buckets = {
            "all": correct,
            "within": [c for c, x in zip(correct, dist) if x < train_len],
            "beyond": [c for c, x in zip(correct, dist) if x >= train_len],
        }
        for name, cs in buckets.items():
            if not cs:
                continue
            rows.append(
                {
                    "arm": eval_label(arm, p),
                    "train_attn": arm.train_attn,
                    "eval_attn": (
                        "lssar"
                        if p is not None
                        else f"{arm.train_attn} window={train_len}"
                        if arm.window
                        else arm.train_attn
                    ),
                    "eval_p": arm.train_p if p is None else p,
                    "seed": seed,
                    "length_multiple": int(m),
                    "distance": name,
                    "accuracy": sum(cs) / len(cs),
                    "queries": len(cs),
                }
            )
    return rows


def _eval_ps(cfg: StudyConfig, arm: Arm) -> list[float | None]:
    """The evaluation rules of an arm: its own (None), then its eval-time re-weighting sweep."""
    return [None] + list(
        arm.eval_ps if cfg.eval_ps is None else (cfg.eval_ps if arm.eval_ps else ())
    )


def units(cfg: StudyConfig) -> list[tuple[int, tuple[str, ...]]]:
    """``(seed, arms)`` per trained model, seeds outermost: arms sharing a run (window and
    softmax) form one unit, so the model trains once."""
    out: dict[tuple[int, str], list[str]] = {}
    for seed in cfg.seeds:
        for a in cfg.arms:
            key = (seed, run_dir(Path(), cfg, ARMS[a], seed).name)
            out.setdefault(key, []).append(a)
    return [(seed, tuple(arms)) for (seed, _), arms in out.items()]


def run_unit(
    cfg: StudyConfig,
    seed: int,
    arms: tuple[str, ...],
    runs: Path,
    progress: bool = False,
    threads: int | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train (or reuse) one model and evaluate every arm on it with every rule: (info, rows)."""
    if threads is not None:
        torch.set_num_threads(threads)
    model, done = train_arm(cfg, ARMS[arms[0]], seed, runs, progress)
    rd = run_dir(runs, cfg, ARMS[arms[0]], seed)
    info, rows = [], []
    for name in arms:
        arm = ARMS[name]
        info.append(
            {
                "arm": arm.name,
                "seed": seed,
                "run": str(rd),
                "train_seconds": done.get("train_seconds"),
                "final_train_acc": (done.get("log") or [{}])[-1].get("acc"),
                "git_sha": done.get("env", {}).get("git_sha"),
                "git_dirty": done.get("env", {}).get("git_dirty"),
            }
        )
        for p in _eval_ps(cfg, arm):
            ev = evaluate_arm(model, cfg, arm, p, rd)
            rows += tidy_rows(arm, p, seed, ev, cfg.task.train_len)
    return info, rows


def run_study(
    cfg: StudyConfig,
    out: str | Path,
    runs: str | Path,
    progress: bool = True,
    name: str = "custom",
    attention_maps: bool = True,
) -> Path:
    """Train/reuse every (arm, seed), evaluate, write ``results.json``, REPORT.md and plots."""
    from lssar.recall.report import write_report

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    out, runs = Path(out), Path(runs)
    started = time.time()
    todo = units(cfg)
    results: dict[int, tuple[list, list]] = {}
    if cfg.jobs > 1 and len(todo) > 1:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc=f"models ({cfg.jobs} workers)")
        ctx = mp.get_context("spawn")  # fork after torch has threads can deadlock
        with ProcessPoolExecutor(cfg.jobs, mp_context=ctx) as ex:
            futs = {
                ex.submit(run_unit, cfg, seed, arms, runs, False, 1): i
                for i, (seed, arms) in enumerate(todo)
            }
            for f in as_completed(futs):
                results[futs[f]] = f.result()
                seed, arms = todo[futs[f]]
                msg = f"done: {', '.join(arms)} (seed {seed})"
                if bar is None:
                    print(msg, flush=True)
                else:
                    bar.write(msg)
                    bar.update(1)
        if bar is not None:
            bar.close()
    else:
        for i, (seed, arms) in enumerate(todo):
            print(f"== {', '.join(arms)} (seed {seed})", flush=True)
            results[i] = run_unit(cfg, seed, arms, runs, progress)
    train_info = [x for i in sorted(results) for x in results[i][0]]
    rows = [r for i in sorted(results) for r in results[i][1]]
    models: dict[str, tuple[RecallModel, Arm]] = {}
    if attention_maps:  # the first seed's models (finished: loaded, not trained)
        for seed, arms in todo:
            if seed == cfg.seeds[0]:
                model, _ = train_arm(cfg, ARMS[arms[0]], seed, runs, progress=False)
                for a in arms:
                    models[a] = (model, ARMS[a])
    models = {a: models[a] for a in cfg.arms if a in models}
    meta = {
        "preset": name,
        "config": dataclasses.asdict(cfg),
        "runs": train_info,
        "seconds": time.time() - started,
        "date": dt.date.today().isoformat(),
        "env": environment("cpu"),
    }
    write_report(rows, meta, out, models or None, cfg)
    return out


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="lssar recall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset", default="quick", help=", ".join(f"{k} ({v.budget})" for k, v in PRESETS.items())
    )
    ap.add_argument("--out", help="report directory (default reports/recall-PRESET-DATE)")
    ap.add_argument("--runs", help="run directories (default runs/recall)")
    ap.add_argument("--arms", help=f"comma-separated subset of: {', '.join(ARMS)}")
    ap.add_argument("--seeds", help="comma-separated seeds (default: the preset's)")
    ap.add_argument("--jobs", type=int, help="worker processes (default: the preset's)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    over: dict[str, Any] = {}
    if args.arms:
        over["arms"] = tuple(a.strip() for a in args.arms.split(","))
    if args.seeds:
        try:
            over["seeds"] = tuple(int(s) for s in args.seeds.split(","))
        except ValueError:
            raise ValueError(f"--seeds {args.seeds!r}: expected integers like 0,1,2") from None
    if args.jobs is not None:
        over["jobs"] = args.jobs
    cfg = preset_config(args.preset, **over)
    out = Path(args.out or f"reports/recall-{args.preset}-{dt.date.today().isoformat()}")
    run_study(cfg, out, Path(args.runs or "runs/recall"), not args.no_progress, args.preset)
    print((out / "REPORT.md").read_text())
    print(f"report: {out / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
