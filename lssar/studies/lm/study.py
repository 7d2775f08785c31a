"""``lssar reproduce``: train one model per attention arm, evaluate them all, write a report.

Every arm of a preset shares data, seed, budget and model size; only the attention differs.
Finished runs and evaluations are reused and unfinished runs resume, so re-running a preset
continues where it stopped. Each finished unit's results are carried in the report directory
(``units/<run>.json``: :class:`lssar.studies.common.Study`), so the same ``--out`` on another
machine continues the study without the runs of its finished units. The report
(``reports/<preset>-<date>/REPORT.md`` + JSON + plots) is written by
:mod:`lssar.studies.lm.report` from the units' results.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from lssar.ops import get_variant
from lssar.runio import child_path
from lssar.spec import AttentionSpec
from lssar.studies.common import Arm, Study, select_arms, study_args, study_parser, units_by_run
from lssar.studies.lm import report
from lssar.studies.lm.evaluate import evaluate_run
from lssar.studies.lm.presets import ARMS, PRESETS, Preset, get_preset

if TYPE_CHECKING:
    from lssar.train.config import TrainConfig


def at_training_length(spec: AttentionSpec, seq_len: int) -> AttentionSpec:
    """``spec`` with ``n`` = the training length for a constant-scale variant that does not set
    it (softmax-qknorm-const / -learned, lssa-const: LSSA's scale frozen at ln d ln L); any
    other spec unchanged."""
    if "n" in get_variant(spec.name).options and "n" not in spec.options:
        return AttentionSpec(spec.name, {**spec.options, "n": seq_len}, spec.impl)
    return spec


def _run_name(preset: str, arm: Arm, seed: int) -> str:
    """Runs are named by the trained rule and positions: arms that train alike (softmax, its
    window control, its RoPE scalings) share one; RoPE runs keep their earlier names."""
    pos = "" if arm.pos == "rope" else f"-{arm.pos}"
    return f"{preset}-{arm.attention.slug()}{pos}-s{seed}"


def _steps_done(run: Path) -> int:
    """The last training step ``run/log.jsonl`` records (0 before the first). Read while the run
    trains, so a line being appended is skipped, not reported."""
    try:
        lines = (run / "log.jsonl").read_bytes().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            return rec["step"]
    return 0


class CommandProgress:
    """Every ``every`` seconds, one line for the whole command: training steps done over all its
    runs, time elapsed, and about how long is left at the rate of the steps done so far
    (evaluations included, since they take their share of the elapsed time). Reads each run's
    ``log.jsonl``, so it works alike with ``--jobs``."""

    def __init__(self, runs: list[Path], steps_per_run: int, every: float = 30.0) -> None:
        self.runs, self.total, self.every = runs, steps_per_run * len(runs), every
        self.before = self.done()  # finished or resumed work is not this invocation's rate
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def done(self) -> int:
        return sum(_steps_done(r) for r in self.runs)

    def line(self) -> str:
        done, elapsed = self.done(), time.time() - self.started
        head = f"[whole command] {done:,}/{self.total:,} training steps over {len(self.runs)} runs"
        head += f", {elapsed / 60:.1f} min elapsed"
        new = done - self.before
        if done >= self.total:
            return head + "; training done, the last evaluations are running"
        if new <= 0:
            return head + "; time left: after the first logged steps"
        left = (self.total - done) * elapsed / new / 60
        return head + f", about {left:.0f} min left"

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            tqdm.write(self.line(), file=sys.stderr)

    def __enter__(self) -> CommandProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def runs_suffix(preset: Preset, smoke: bool = False) -> str:
    """``-dtype-fp32``: the training settings a preset sets over its training preset's, in its
    runs directory's name (a run of other settings under the same name would be refused)."""
    if smoke:  # a smoke test's runs live apart already
        return ""
    return "".join(f"-{k.replace('_', '-')}-{v}" for k, v in sorted(preset.train.items()))


def paper_commands(preset: Preset, runs_dir: Path) -> list[str]:
    """The torchrun and eval commands of the paper preset (one line each, one per run)."""
    from lssar.train.config import load_config

    paper_len = load_config(preset.train_preset, {}).seq_len
    cmds: list[str] = []
    seen: set[str] = set()
    for a in preset.arms:
        arm, name = ARMS[a], _run_name(preset.train_preset, ARMS[a], 0)
        if name in seen:  # a run two arms share (softmax and its window control)
            continue
        seen.add(name)
        train = at_training_length(arm.attention, paper_len).to_train()
        p, n = train["attn_p"], train.get("attn_n")
        flags = f"--attn={arm.attention.name}" + ("" if p is None else f" --attn_p={p:g}")
        flags += "" if n is None else f" --attn_n={n}"
        flags += "" if arm.pos == "rope" else f" --pos={arm.pos}"
        cmds.append(
            f"torchrun --standalone --nproc_per_node=8 -m lssar train --preset "
            f"{preset.train_preset} {flags} --out_dir={runs_dir} --run_name={name}"
        )
        cmds.append(f"lssar eval {runs_dir / name} --lengths 1,2,4,8,16 --passkey")
    return cmds


def evaluate_arm(
    preset: Preset, folder: str, arm: Arm, run: Path, train_len: int, progress: bool = True
) -> list[dict[str, Any]]:
    """The evaluations of one trained run for ``arm``: its own rule, or the sliding window of
    the training length for the window control (with passkey if ``arm`` is one of the preset's
    passkey arms; none for an arm of eval-only rules), then the arm's eval-only rules (the
    paper's fine-tuning-free re-weighting, the RoPE scalings). They go to
    ``RUN/eval/<folder>/`` (the preset's name unless it shares another's): presets that share a
    training run (quick and cpu) keep their own evaluations."""
    kw = dict(
        multiples=preset.multiples,
        eval_tokens=preset.eval_tokens,
        progress=progress,
        folder=folder,
    )
    pk_arms = preset.arms if preset.passkey_arms is None else preset.passkey_arms
    out = []
    passkey = preset.passkey if arm.name in pk_arms else None
    if arm.window:
        out = [evaluate_run(run, window=train_len, passkey=passkey, **kw)]
    elif arm.own_rule:
        out = [evaluate_run(run, passkey=passkey, **kw)]
    for rule in arm.evals:
        a, r = rule.attention, rule.rope
        out.append(
            evaluate_run(
                run,
                attn=None if a is None else a.name,
                attn_p=None if a is None else a.options.get("p"),
                rope_scaling=None if r is None else r.kind,
                rope_factor=None if r is None else r.factor,
                **kw,
            )
        )
    return out


def _unit_config(
    preset: Preset, arm_names: tuple[str, ...], seed: int, runs: Path, overrides: list[str]
) -> TrainConfig:
    """The training config of one unit's run (:func:`_train_and_evaluate`)."""
    from lssar.train.config import load_config, parse_overrides

    arm = ARMS[arm_names[0]]
    given = {**preset.train, **parse_overrides(overrides)}
    seq_len = load_config(preset.train_preset, given).seq_len
    return load_config(
        preset.train_preset,
        {
            **preset.train,
            **at_training_length(arm.attention, seq_len).to_train(),
            "pos": arm.pos,
            "seed": seed,
            "out_dir": str(runs),
            "run_name": _run_name(preset.train_preset, arm, seed),
            **parse_overrides(overrides),
        },
    )


def _train_and_evaluate(
    preset: Preset,
    folder: str,
    arm_names: tuple[str, ...],
    seed: int,
    runs: Path,
    overrides: list[str],
    progress: bool,
) -> list[list[dict[str, Any]]]:
    """One training run and the arms evaluated on it (softmax, its window control and its RoPE
    scalings share one): train (or reuse, or resume) the run once, then evaluate each arm (rank
    0); one list of results per arm."""
    from lssar.train import train

    cfg = _unit_config(preset, arm_names, seed, runs, overrides)
    print(f"== {', '.join(arm_names)} (seed {seed})", flush=True)
    run = train(cfg, resume=True, progress=progress)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 evaluates
        return [[] for _ in arm_names]
    return [evaluate_arm(preset, folder, ARMS[a], run, cfg.seq_len, progress) for a in arm_names]


@dataclass
class LMStudy(Study):
    """``lssar reproduce``: one unit per training run (its arms, its seed), each trained with
    :func:`lssar.train.train` and evaluated with :func:`lssar.studies.lm.evaluate.evaluate_run`;
    the report reads the results in (seed, arm) order, whatever the grouping or the workers."""

    name: str
    preset: Preset
    runs: Path
    out: Path
    overrides: list[str]
    progress: bool

    def units(self) -> list[tuple[Any, ...]]:
        p = self.preset
        groups = units_by_run(p.arms, p.seeds, lambda a, s: _run_name(p.train_preset, ARMS[a], s))
        folder = p.eval_folder or self.name
        return [
            (p, folder, arms, seed, self.runs, self.overrides, self.progress)
            for seed, arms in groups
        ]

    def run_unit(self, *unit: Any) -> list[list[dict[str, Any]]]:
        return _train_and_evaluate(*unit)

    def unit_key(self, *unit: Any) -> dict[str, Any]:
        """What a unit's results depend on: its run's training config (without where it lives
        or how it is watched), its arms (their trained and eval-only rules) and the preset's
        evaluation settings; the carried results of a unit are reused while it matches."""
        from lssar.train.config import BOOKKEEPING

        preset, _, arm_names, seed, runs, overrides, _ = unit
        cfg = _unit_config(preset, arm_names, seed, runs, overrides)
        pk_arms = preset.arms if preset.passkey_arms is None else preset.passkey_arms
        arms = {
            a: [ARMS[a].trained_label, ARMS[a].window, ARMS[a].own_rule]
            + [e.label for e in ARMS[a].evals]
            for a in arm_names
        }
        passkey = None if preset.passkey is None else dataclasses.asdict(preset.passkey)
        # a setting left unset (None) is left out, so a field added later with a None default
        # does not make every carried unit stale
        train = {
            k: v
            for k, v in dataclasses.asdict(cfg).items()
            if k not in BOOKKEEPING and v is not None
        }
        return json.loads(json.dumps({
            "train": train,
            "arms": arms,
            "eval": {"multiples": preset.multiples, "eval_tokens": preset.eval_tokens},
            "passkey": {a: passkey for a in arm_names if a in pk_arms},
        }))  # fmt: skip

    def unit_file(self, *unit: Any) -> str:
        preset, _, arm_names, seed, *_ = unit
        return f"{_run_name(preset.train_preset, ARMS[arm_names[0]], seed)}.json"

    def check_unit(self, *unit: Any) -> None:
        """Refuse a unit whose run exists with another config, before any unit starts: a
        refusal found by a running pool came after other units had trained with the new
        config (and then the old command was refused by that run)."""
        from lssar.train.runs import check_same_config, stored_train_config

        preset, _, arm_names, seed, runs, overrides, _ = unit
        cfg = _unit_config(preset, arm_names, seed, runs, overrides)
        run_dir = child_path(cfg.out_dir, cfg.run_name, "run_name")  # as train() finds it
        if (stored := stored_train_config(run_dir)) is not None:
            check_same_config(stored, cfg, run_dir)

    def unit_name(self, *unit: Any) -> str:
        return f"the run of {', '.join(unit[2])} (seed {unit[3]})"

    def write_report(self, results: list[Any], seconds: float) -> Path:
        by_arm = {}  # (seed, arm) -> its results
        for (_, _, arms, seed, *_), per_arm in zip(self.units(), results):
            by_arm.update({(seed, a): rs for a, rs in zip(arms, per_arm)})
        flat = [
            r for seed in self.preset.seeds for a in self.preset.arms for r in by_arm[(seed, a)]
        ]
        if int(os.environ.get("RANK", "0")) != 0:
            return self.out
        return report.write_report(self.name, self.preset, flat, self.out, seconds)


def run_study(
    preset_name: str,
    runs: str | Path | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    overrides: list[str] | None = None,
    jobs: int = 1,
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    smoke: bool = False,
) -> Path:
    """Train + evaluate every arm of ``preset_name`` (or ``arms``, ``seeds``); returns the
    report directory (``out``, default ``reports/<preset>-<date>``).

    ``jobs > 1`` trains and evaluates that many runs at once, in worker processes of one torch
    thread each (not under torchrun, whose ranks train each run together). ``smoke``: the
    preset's :func:`~lssar.studies.lm.presets.smoke` test (a few steps and tokens per arm; its
    own runs directory and report)."""
    preset = get_preset(preset_name, smoke)
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: need at least 1 worker")
    if jobs > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"--jobs {jobs} under torchrun: the ranks already share each run; drop it")
    if arms is not None or seeds is not None:
        preset = dataclasses.replace(
            preset,
            arms=select_arms(ARMS, arms) if arms is not None else preset.arms,
            seeds=list(seeds) if seeds is not None else preset.seeds,
        )
    # Runs are named by the training preset, so presets that share it (quick, cpu) share runs;
    # a smoke test's live apart.
    kind = "smoke-" if smoke else ""
    runs = Path(runs or f"runs/reproduce-{kind}{preset.train_preset}{runs_suffix(preset, smoke)}")
    out = Path(out or f"reports/{preset_name}-{kind}{dt.date.today().isoformat()}")
    name = f"{preset_name} --smoke" if smoke else preset_name
    study = LMStudy(name, preset, runs, out, list(overrides or []), progress and jobs == 1)
    from lssar.train.config import load_config, parse_overrides

    given = {**preset.train, **parse_overrides(list(overrides or []))}
    steps = load_config(preset.train_preset, given).max_steps
    run_dirs = [
        runs / _run_name(preset.train_preset, ARMS[u[2][0]], u[3])
        for u in study.units()
        if study.carried(*u) is None  # a carried unit trains nothing here
    ]
    tell = progress and int(os.environ.get("RANK", "0")) == 0
    if tell:
        print(
            f"lssar reproduce --preset {name}: {len(run_dirs)} training runs of {steps} "
            f"steps and their evaluations ({preset.budget or 'no estimate'}); a [whole command] "
            "line every 30 s says how long is left",
            flush=True,
        )
    with CommandProgress(run_dirs, steps) if tell else contextlib.nullcontext():
        return study.run(jobs).report


def rewrite_report(preset_name: str, out: str | Path | None) -> Path:
    """``--report-only``: the report in ``out`` rewritten from its own results.json (the same
    runs and evaluations) with this version's report code; returns ``out``."""
    if out is None:
        raise ValueError("--report-only rewrites an existing report: name it with --out DIR")
    out = Path(out)
    try:
        data = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--report-only: cannot read {out / 'results.json'} ({e})") from None
    if data.get("preset") != preset_name:
        raise ValueError(
            f"--report-only: {out} is a report of preset {data.get('preset')!r}, not "
            f"{preset_name!r}; pass --preset {data.get('preset')}"
        )
    return report.write_report(
        preset_name, get_preset(preset_name), data["results"], out, 0.0, rewritten=True
    )


def parser() -> argparse.ArgumentParser:
    """``lssar reproduce``'s options, each described (``lssar reproduce --help``)."""
    ap = study_parser(
        "lssar reproduce",
        __doc__,
        PRESETS,
        ARMS,
        runs="runs/reproduce-TRAIN_PRESET, with -KEY-VALUE for each training setting the preset "
        "sets (runs/reproduce-smoke-TRAIN_PRESET with --smoke)",
        out="reports/PRESET-DATE (reports/PRESET-smoke-DATE with --smoke)",
        renamed={"--runs-dir": "--runs"},
    )
    ap.add_argument("--reports-dir", help=argparse.SUPPRESS)  # deprecated: the parent of --out
    ap.add_argument(
        "--execute",
        action="store_true",
        help="paper preset: run the torchrun commands here instead of printing them",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the report in --out from its results.json with this version's report "
        "code: no training, no evaluation",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="check that this install runs the preset: every arm for a few steps on few tokens, "
        "one seed (runs/reproduce-smoke-*, reports/PRESET-smoke-DATE); measures nothing",
    )
    ap.epilog += (
        "\n\nAny other --key=value is a training setting over the preset's (lssar train --help "
        "lists them), e.g. --max_steps=100."
    )
    return ap


def cli(argv: list[str]) -> int:
    ap = parser()
    args, overrides = ap.parse_known_args(argv)
    arms, seeds = study_args(args)
    get_preset(args.preset)  # an unknown name fails first
    if args.reports_dir is not None:
        print(
            "note: --reports-dir is deprecated, use --out (the report directory)", file=sys.stderr
        )
        stamp = f"{'smoke-' if args.smoke else ''}{dt.date.today().isoformat()}"
        args.out = args.out or str(Path(args.reports_dir) / f"{args.preset}-{stamp}")
    if args.report_only:
        out = rewrite_report(args.preset, args.out)
        print(f"report: {out / 'REPORT.md'}")
        return 0
    if args.preset == "paper" and not args.execute:
        if args.smoke:
            raise ValueError("--smoke runs the paper preset here: add --execute")
        runs = Path(args.runs or f"runs/reproduce-{PRESETS['paper'].train_preset}")
        print(
            f"# {PRESETS['paper'].description}\n# expected time: {PRESETS['paper'].budget}\n"
            "# run these on a GPU node, or there: torchrun --standalone --nproc_per_node=8 "
            "-m lssar reproduce --preset paper --execute\n# (trains every arm in turn, rank 0 "
            "evaluates and writes the report; finished runs are reused)\n"
        )
        print("\n".join(paper_commands(PRESETS["paper"], runs)))
        return 0
    out = run_study(
        args.preset,
        args.runs,
        args.out,
        not args.no_progress,
        overrides,
        args.jobs or 1,
        arms,
        seeds,
        smoke=args.smoke,
    )
    print((out / "REPORT.md").read_text())
    print(f"report: {out / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
