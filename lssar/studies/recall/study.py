"""Training, evaluation and the tidy rows of the recall study (its arms and presets:
:mod:`lssar.studies.recall.presets`).

The model is :class:`lssar.studies.recall.model.RecallModel` (a GPT with a token shift; see that
module for why). Every trained arm shares the task, model size, steps, learning-rate schedule
and training batches of a seed (batch ``k`` of seed ``s`` is ``task.batch((s, k), ...)``); only
the attention differs. Every arm is scored on the same evaluation sequences. Training is fp32
(the CPUs this runs on have no native bf16). A run lives in ``RUNS/<arm>-s<seed>-<config
hash>/``, a run directory of :mod:`lssar.train.checkpoint` (``config.json``, ``env.json``,
``log.jsonl``, ``ckpt/latest.pt`` every ``ckpt_every`` steps, ``ckpt/final.pt`` and ``DONE``
once finished) with one ``eval-*.json`` per evaluation rule beside them; finished runs are
reused, unfinished runs resume from their checkpoint (one trainer per run: a lock), and a
changed setting gets a new hash; an evaluation is reused only under its key (the model's sha256,
the rule, the evaluation sequences and the code), never stale. With ``jobs > 1`` the (seed,
model) units train and evaluate in that many worker processes of one thread each (tiny models
use one core far better than two threads do); the results do not depend on ``jobs``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lssar import clihelp
from lssar.model import GPTConfig
from lssar.runio import atomic_write, environment
from lssar.studies.common import (
    Arm,
    EvalRule,
    Study,
    code_digest,
    study_args,
    study_parser,
    units_by_run,
)
from lssar.studies.labels import eval_label
from lssar.studies.recall.model import RecallModel
from lssar.studies.recall.presets import (
    ARMS,
    EVAL_SEED,
    PRESETS,
    SET_HELP,
    SET_SKIP,
    TASK_HELP,
    StudyConfig,
    eval_rules,
    parse_set,
    preset_config,
    train_p,
)
from lssar.studies.recall.task import IGNORE, RecallTask
from lssar.train.checkpoint import (
    CONFIG,
    DONE,
    ENV,
    FINAL,
    RunDir,
    file_sha256,
    load_checkpoint,
    load_state,
    open_run,
    read_json,
    read_log,
)
from lssar.train.schedule import set_lr, warmup_cosine

# what an evaluation's scores depend on besides the model and the settings
_EVAL_SOURCES = (
    "studies/recall/model.py",
    "studies/recall/task.py",
    "model.py",
    "positions.py",
    "spec.py",
    "ops",
)

# ------------------------------------------------------------------------------- training


def run_dir(runs: Path, cfg: StudyConfig, arm: Arm, seed: int) -> Path:
    """The run of ``arm``/``seed``. A window of ``train_len`` at the training length is the
    whole causal context, so the window arm *trains* exactly as softmax: it shares softmax's run
    (one model) and differs only at evaluation, where the window hides keys >= L back."""
    d = _train_key(cfg, arm)
    h = hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]
    name = arm.attention.slug() + ("" if arm.pos == "rope" else f"-{arm.pos}")
    return runs / f"{name}-s{seed}-{h}"


def _train_key(cfg: StudyConfig, arm: Arm) -> dict[str, Any]:
    """What a model depends on; ``pos`` only when it is not RoPE, so the RoPE runs of every
    earlier version keep their names."""
    d = cfg.train_dict() | {"attn": arm.attention.name, "p": train_p(arm)}
    return d if arm.pos == "rope" else d | {"pos": arm.pos}


def build_model(cfg: StudyConfig, arm: Arm) -> RecallModel:
    return RecallModel(
        GPTConfig(
            vocab_size=cfg.task.vocab_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            attn=arm.attention.name,
            attn_options=dict(arm.attention.options),
            pos=arm.pos,
        ),
        token_shift=cfg.token_shift,
    )


def train_arm(
    cfg: StudyConfig,
    arm: Arm,
    seed: int,
    runs: Path,
    progress: bool = True,
    stop_after: int | None = None,
) -> tuple[RecallModel, dict[str, Any]]:
    """Train (or reuse, or resume) one arm/seed; returns the model and its record
    (:func:`_record`).

    ``stop_after`` stops (with a checkpoint) after that many steps of this call: for tests of
    resume, and to spread a long preset over several invocations.
    """
    rd = run_dir(runs, cfg, arm, seed)
    if (finished := _finished(cfg, arm, rd)) is not None:
        return finished
    # one trainer per run (two invocations, one runs dir); the name hashes the config, which
    # config.json holds and a resume checks
    with open_run(rd, _train_key(cfg, arm), what="recall run") as run:
        if (finished := _finished(cfg, arm, rd)) is not None:  # by the lock's last holder
            return finished
        return _train_arm(cfg, arm, seed, run, progress, stop_after)


def _record(rd: Path) -> dict[str, Any]:
    """A finished run's record: its ``DONE`` summary (``arm``, ``seed``, ``steps``,
    ``train_seconds``), ``log`` (training loss and accuracy every 50 steps), ``env`` and
    ``config``."""
    done = read_json(rd / DONE)
    return done | {
        "finished": True,
        "log": read_log(rd),
        "env": read_json(rd / ENV),
        "config": read_json(rd / CONFIG),
    }


def _finished(cfg: StudyConfig, arm: Arm, rd: Path) -> tuple[RecallModel, dict[str, Any]] | None:
    if not ((rd / DONE).is_file() and (rd / FINAL).is_file()):
        return None
    model = build_model(cfg, arm)
    load_state(model, load_checkpoint(rd / FINAL)["model"], rd / FINAL)
    return model.eval(), _record(rd)


def _train_arm(
    cfg: StudyConfig, arm: Arm, seed: int, run: RunDir, progress: bool, stop_after: int | None
) -> tuple[RecallModel, dict[str, Any]]:
    torch.manual_seed(seed)
    model = build_model(cfg, arm)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    state = run.resume(model, opt)
    start, elapsed = (0, 0.0) if state is None else (state["step"], state["elapsed"])
    run.start(start, environment("cpu"))
    L = cfg.task.train_len
    window = L if arm.window else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{arm.name} s{seed}", leave=False)
    t0, done_here, acc_sum, loss_sum, n = time.time(), 0, 0.0, 0.0, 0
    model.train()
    for step in range(start, cfg.steps):
        b = cfg.task.batch((seed, step), L, cfg.batch_size)
        lr = warmup_cosine(step, total=cfg.steps, peak=cfg.lr, warmup=cfg.warmup, floor_ratio=0.1)
        set_lr(opt, lr)
        logits, _ = model(b["tokens"], window=window)
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
            run.log(step=step + 1, loss=loss_sum / n, acc=acc_sum / n)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_sum / n:.3f}", acc=f"{acc_sum / n:.2f}")
            acc_sum = loss_sum = 0.0
            n = 0
        if bar is not None:
            bar.update(1)
        done_here += 1
        last = step + 1 == cfg.steps
        stop = stop_after is not None and done_here >= stop_after and not last
        if (step + 1) % cfg.ckpt_every == 0 or stop or last:
            run.save(step + 1, model, opt, elapsed=elapsed + time.time() - t0)
        if stop:
            if bar is not None:
                bar.close()
            return model.eval(), {"finished": False, "step": step + 1}
    if bar is not None:
        bar.close()
    seconds = elapsed + time.time() - t0
    run.finish(arm=arm.name, seed=seed, steps=cfg.steps, train_seconds=seconds)
    return model.eval(), _record(run.path)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_arm(
    model: RecallModel, cfg: StudyConfig, arm: Arm, rule: EvalRule | None, rd: Path
) -> dict[str, dict[str, list[int]]]:
    """Per length multiple: ``correct`` (0/1) and ``distance`` of every scored query, for the
    finished run ``rd``; cached in ``rd/eval-<rule>-<eval_seqs>.json`` under a key of what they
    depend on. ``rule`` set = evaluate with that eval-only rule (re-weighting at some p, a RoPE
    scaling from the training length)."""
    name = ("window-sink" if arm.window else "trained") if rule is None else rule.slug()
    path = rd / f"eval-{name}-{cfg.eval_seqs}.json"
    # what the scores depend on: the model's weights (ckpt/final.pt; a retrained run is another
    # model), the rule, the evaluation sequences (eval_batch cuts them into seeded chunks) and
    # the code; each length multiple is cached under it and added to it when asked for
    key = json.loads(
        json.dumps(
            {
                "model_sha256": file_sha256(rd / FINAL),  # a finished run's
                "rule": name,
                "task": dataclasses.asdict(cfg.task),
                "eval_seqs": cfg.eval_seqs,
                "eval_batch": cfg.eval_batch,
                "eval_seed": EVAL_SEED,
                "code": code_digest(_EVAL_SOURCES),
            },
            default=str,
        )
    )
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:  # a damaged cache is recomputed, never trusted
        stored = {}
    ok = isinstance(stored, dict) and stored.get("key") == key
    cached = dict(stored["scores"]) if ok else {}
    model.set_attention(arm.attention.name, dict(arm.attention.options))
    if rule is not None and rule.attention is not None:
        model.set_attention(rule.attention.name, dict(rule.attention.options))
    if rule is not None and rule.rope is not None:
        model.gpt.set_rope_scaling(rule.rope, cfg.task.train_len)
    model.eval()
    L = cfg.task.train_len
    changed = False
    for m in cfg.multiples:
        if str(m) in cached:
            continue
        T = m * L
        window = L if arm.window else None
        correct, dist = [], []
        for c in range(0, cfg.eval_seqs, cfg.eval_batch):
            size = min(cfg.eval_batch, cfg.eval_seqs - c)
            b = cfg.task.batch((EVAL_SEED, m, c), T, size)
            logits, _ = model(b["tokens"], window=window)
            qp = b["query_pos"]
            pred = logits.gather(1, qp[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
            correct += (pred == b["answer"]).flatten().int().tolist()
            dist += b["distance"].flatten().tolist()
        cached[str(m)] = {"correct": correct, "distance": dist}
        changed = True
    if changed:
        atomic_write(path, json.dumps({"key": key, "scores": cached}))
    model.set_attention(arm.attention.name, dict(arm.attention.options))
    model.gpt.set_rope_scaling(None)
    return {str(m): cached[str(m)] for m in cfg.multiples}


def tidy_rows(
    arm: Arm,
    rule: EvalRule | None,
    seed: int,
    ev: dict[str, dict[str, list[int]]],
    train_len: int,
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
            switched = None if rule is None else rule.attention
            rows.append(
                {
                    "arm": eval_label(arm, rule),
                    "train_attn": arm.attention.name,
                    "train_pos": arm.pos,
                    "eval_attn": (
                        switched.name
                        if switched is not None
                        else f"{arm.attention.name} window={train_len}"
                        if arm.window
                        else arm.attention.name
                    ),
                    "eval_p": train_p(arm) if switched is None else switched.options.get("p"),
                    "eval_rope": None if rule is None or rule.rope is None else rule.rope.label,
                    "seed": seed,
                    "length_multiple": int(m),
                    "distance": name,
                    "accuracy": sum(cs) / len(cs),
                    "queries": len(cs),
                }
            )
    return rows


def _eval_rules(cfg: StudyConfig, arm: Arm) -> list[EvalRule | None]:
    """The evaluation rules of an arm: its own (None; not for an arm of eval-only rules), then
    its eval-only rules (the re-weighting sweep, ``cfg.eval_ps`` if set; RoPE scalings)."""
    own: list[EvalRule | None] = [None] if arm.own_rule else []
    return own + list(eval_rules(arm, cfg.eval_ps))


def units(cfg: StudyConfig) -> list[tuple[int, tuple[str, ...]]]:
    """``(seed, arms)`` per trained model, seeds outermost: arms sharing a run (window and
    softmax) form one unit, so the model trains once."""
    return units_by_run(cfg.arms, cfg.seeds, lambda a, s: run_dir(Path(), cfg, ARMS[a], s).name)


def run_unit(
    cfg: StudyConfig, seed: int, arms: tuple[str, ...], runs: Path, progress: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train (or reuse) one model and evaluate every arm on it with every rule: (info, rows)."""
    if progress:
        print(f"== {', '.join(arms)} (seed {seed})", flush=True)
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
                **{
                    k: done.get("env", {}).get(k)
                    for k in ("git_sha", "git_dirty", "argv", "threads", "cpu_isa")
                },
            }
        )
        for rule in _eval_rules(cfg, arm):
            ev = evaluate_arm(model, cfg, arm, rule, rd)
            rows += tidy_rows(arm, rule, seed, ev, cfg.task.train_len)
    return info, rows


@dataclass
class RecallStudy(Study):
    """``lssar recall``: one unit per trained model (its seed, the arms evaluated on it), each
    trained (:func:`train_arm`) and evaluated with every rule (:func:`run_unit`); the report
    (:mod:`lssar.studies.recall.report`) gets the tidy rows and the first seed's models for the
    attention maps."""

    cfg: StudyConfig
    runs: Path
    out: Path
    name: str = "custom"
    progress: bool = True  # inside a unit: bars per model (one unit at a time only)
    attention_maps: bool = True

    def units(self) -> list[tuple[Any, ...]]:
        return units(self.cfg)

    def run_unit(self, seed: int, arms: tuple[str, ...]) -> Any:
        return run_unit(self.cfg, seed, arms, self.runs, self.progress)

    def write_report(self, results: list[Any], seconds: float) -> Path:
        from lssar.studies.recall.report import write_report

        cfg = self.cfg
        train_info = [x for info, _ in results for x in info]
        rows = [r for _, unit_rows in results for r in unit_rows]
        models: dict[str, tuple[RecallModel, Arm]] = {}
        if self.attention_maps:  # the first seed's models (finished: loaded, not trained)
            for seed, arms in self.units():
                if seed == cfg.seeds[0]:
                    model, _ = train_arm(cfg, ARMS[arms[0]], seed, self.runs, progress=False)
                    for a in arms:
                        models[a] = (model, ARMS[a])
        models = {a: models[a] for a in cfg.arms if a in models}
        meta = self._meta(seconds, runs=train_info)
        write_report(rows, meta, self.out, models or None, cfg)
        return self.out

    def _meta(self, seconds: float, **extra: Any) -> dict[str, Any]:
        """What the report records of this invocation; ``runs`` after the config, ``command``
        before the environment (the order of earlier reports)."""
        meta = {"preset": self.name, "config": dataclasses.asdict(self.cfg)}
        if "runs" in extra:
            meta["runs"] = extra.pop("runs")
        meta |= {"seconds": seconds, "date": dt.date.today().isoformat()}
        return meta | extra | {"env": environment("cpu")}


@dataclass
class RecallPilot(RecallStudy):
    """``lssar recall --pilot``: train only; ``PILOT.md`` with each model's training accuracy
    against step."""

    command: str = "lssar.studies.recall.study.run_pilot"

    def run_unit(self, seed: int, arms: tuple[str, ...]) -> Any:
        return pilot_unit(self.cfg, seed, arms, self.runs, self.progress)

    def write_report(self, results: list[Any], seconds: float) -> Path:
        from lssar.studies.recall.report import write_pilot

        return write_pilot(results, self._meta(seconds, command=self.command), self.out)


def _run(study: RecallStudy, progress: bool) -> Path:
    """Run ``study`` with the config's workers (one unit: in this process), a bar over the
    units when there are several workers."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    todo = study.units()
    jobs = study.cfg.jobs if len(todo) > 1 else 1
    study.progress = progress and jobs == 1
    bar = None
    if progress and jobs > 1:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"models ({jobs} workers)")

    def finished(i: int, _: Any) -> None:
        if bar is not None:
            bar.write(f"done: {', '.join(todo[i][1])} (seed {todo[i][0]})")
            bar.update(1)

    try:
        return study.run(jobs, finished).report
    finally:
        if bar is not None:
            bar.close()


def run_study(
    cfg: StudyConfig,
    out: str | Path,
    runs: str | Path,
    progress: bool = True,
    name: str = "custom",
    attention_maps: bool = True,
) -> Path:
    """Train/reuse every (arm, seed), evaluate, write ``results.json``, REPORT.md and plots."""
    study = RecallStudy(cfg, Path(runs), Path(out), name, attention_maps=attention_maps)
    return _run(study, progress)


def pilot_unit(
    cfg: StudyConfig, seed: int, arms: tuple[str, ...], runs: Path, progress: bool = False
) -> dict[str, Any]:
    """Train (or reuse) one model, no evaluation: its training log, for a pilot."""
    _, done = train_arm(cfg, ARMS[arms[0]], seed, runs, progress)
    return {
        "arms": list(arms),
        "seed": seed,
        "run": str(run_dir(runs, cfg, ARMS[arms[0]], seed)),
        "log": done["log"],
        "train_seconds": done.get("train_seconds"),
        "env": done.get("env", {}),
    }


def run_pilot(
    cfg: StudyConfig,
    out: str | Path,
    runs: str | Path,
    progress: bool = True,
    name: str = "custom",
    command: str = "lssar.studies.recall.study.run_pilot",
) -> Path:
    """Train every model of ``cfg`` and write ``PILOT.md`` + ``pilot.json``: training accuracy
    against step for each, and the step at which it learned the task (or that it did not).
    This is how a setting is sized before a study runs in it (``lssar recall --pilot``)."""
    return _run(RecallPilot(cfg, Path(runs), Path(out), name, command=command), progress)


def parser() -> argparse.ArgumentParser:
    """``lssar recall``'s options and ``--set`` keys, each described (``lssar recall --help``)."""
    base = StudyConfig()
    keys = clihelp.keys_help(StudyConfig, SET_HELP, base, form="{key}={value}", skip=SET_SKIP)
    task = clihelp.keys_help(
        RecallTask, TASK_HELP, base.task, {"pair_order": ["kv", "vk"]}, "{key}={value}", "task."
    )
    ap = study_parser(
        "lssar recall",
        __doc__,
        PRESETS,
        ARMS,
        runs="runs/recall",
        out="reports/recall-PRESET-DATE, or reports/pilot-PRESET-DATE with --pilot",
    )
    ap.epilog += (
        "\n\nsettings for --set KEY=VALUE (defaults of the study; a preset sets some of its "
        f"own):\n{keys}\n{task}"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting of the preset (listed below), e.g. steps=3000, "
        "token_shift=false, task.n_pairs=2",
    )
    ap.add_argument(
        "--pilot",
        action="store_true",
        help="train only and report training accuracy against step (PILOT.md): size a "
        "setting before studying it",
    )
    return ap


def cli(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    arms, seeds = study_args(args)
    over: dict[str, Any] = parse_set(args.set)
    if arms:
        over["arms"] = tuple(arms)
    if seeds:
        over["seeds"] = tuple(seeds)
    if args.jobs is not None:
        over["jobs"] = args.jobs
    cfg = preset_config(args.preset, **over)
    kind = "pilot" if args.pilot else "recall"
    out = Path(args.out or f"reports/{kind}-{args.preset}-{dt.date.today().isoformat()}")
    runs = Path(args.runs or "runs/recall")
    if args.pilot:
        command = " ".join(["lssar recall", *argv])
        run_pilot(cfg, out, runs, not args.no_progress, args.preset, command)
        report = out / "PILOT.md"
    else:
        run_study(cfg, out, runs, not args.no_progress, args.preset)
        report = out / "REPORT.md"
    print(report.read_text())
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
