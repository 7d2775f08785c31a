"""``lssar reproduce``: train one model per attention arm, evaluate them all, write a report.

Every arm of a preset shares data, seed, budget and model size; only the attention differs.
Finished runs and evaluations are reused and unfinished runs resume, so re-running a preset
continues where it stopped. The report (``reports/<preset>-<date>/REPORT.md`` + JSON + plots) is
generated from the run directories by :mod:`lssar.reproduce_report`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lssar.evaluate import PasskeySettings, evaluate_run
from lssar.reproduce_report import ALL_ARMS, LSSA, LSSAR15, QKNORM, SOFTMAX, write_report
from lssar.spec import AttentionSpec


@dataclass
class Preset:
    description: str
    train_preset: str
    arms: list[AttentionSpec]
    eval_reweight: list[float] = field(default_factory=list)  # p's applied to lssa at eval only
    window: bool = True  # the sliding-window control: softmax's runs, window = training length
    seeds: list[int] = field(default_factory=lambda: [0])
    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    eval_tokens: int = 32768
    passkey: PasskeySettings | None = None
    passkey_arms: list[AttentionSpec] | None = None  # None: every trained arm
    budget: str = ""


# One-digit keys: a byte tokenizer spends a token per digit, and copying several in a row needs an
# induction circuit this 450-step model lacks (pilot: 2 digits, 600 fine-tuning steps, <= 23% at
# 1x); one digit learned to 100% within 200 steps. The paper's 5-digit keys are 1-2 GPT-2 tokens.
PASSKEY_CPU = PasskeySettings(
    max_steps=1000, check_every=100, lr=3e-3, batch_size=32, digits=1, trials=20
)

PRESETS = {
    "quick": Preset(
        "softmax, lssa (+ eval-time re-weighting p = 1, 3, 8, 15), lssar p=15 and the "
        "sliding-window control; loss to 16x; entropy and first-token mass; 1 seed",
        "tiny-cpu",
        [SOFTMAX, LSSA, LSSAR15],
        eval_reweight=[1.0, 3.0, 8.0, 15.0],
        eval_tokens=16384,
        budget="<= 15 min on 2 CPU cores",
    ),
    "cpu": Preset(
        "every variant of the paper, the sliding-window control and eval-time re-weighting "
        "p = 1, 3, 8, 15, 3 seeds, passkey and numerical health",
        "tiny-cpu",
        ALL_ARMS,
        eval_reweight=[1.0, 3.0, 8.0, 15.0],
        seeds=[0, 1, 2],
        eval_tokens=32768,
        passkey=PASSKEY_CPU,
        passkey_arms=[SOFTMAX, LSSA, LSSAR15, QKNORM],
        budget="~100 min on 2 CPU cores",
    ),
    "paper": Preset(
        "GPT-2 124M on FineWeb 10B tokens at T=1024 (the paper's setting): a GPU cluster job",
        "gpt2-124m-fineweb",
        ALL_ARMS,
        eval_reweight=[1.0, 3.0, 8.0, 15.0],
        passkey=PasskeySettings(),
        eval_tokens=1 << 21,
        budget="per arm ~3-4 h on 8xH100 (softmax; LSSAR kernels ~1.5x slower): ~1.5 days for "
        "all 9 arms",
    ),
}


def _run_name(preset: str, arm: AttentionSpec, seed: int) -> str:
    return f"{preset}-{arm.slug()}-s{seed}"


def paper_commands(preset: Preset, runs_dir: Path) -> list[str]:
    """The torchrun and eval commands of the paper preset (one line each)."""
    cmds = []
    for arm in preset.arms:
        name = _run_name(preset.train_preset, arm, 0)
        p = arm.to_train()["attn_p"]
        flags = f"--attn={arm.name}" + ("" if p is None else f" --attn_p={p:g}")
        cmds.append(
            f"torchrun --standalone --nproc_per_node=8 -m lssar train --preset "
            f"{preset.train_preset} {flags} --out_dir={runs_dir} --run_name={name}"
        )
        cmds.append(f"lssar eval {runs_dir / name} --lengths 1,2,4,8,16 --passkey")
    return cmds


def evaluate_arm(
    preset_name: str, arm: AttentionSpec, run: Path, train_len: int, progress: bool = True
) -> list[dict[str, Any]]:
    """The evaluations of one trained run of ``arm``: its own rule (with passkey if ``arm`` is
    one of the preset's passkey arms), the sliding-window control on softmax runs (window =
    training length: it trains exactly as softmax), and the eval-time re-weighting sweep on LSSA
    runs (the paper's fine-tuning-free mode). They go to ``RUN/eval/<preset>/``: presets that
    share a training run (quick and cpu) keep their own evaluations."""
    preset = PRESETS[preset_name]
    kw = dict(
        multiples=preset.multiples,
        eval_tokens=preset.eval_tokens,
        progress=progress,
        folder=preset_name,
    )
    pk_arms = preset.arms if preset.passkey_arms is None else preset.passkey_arms
    out = [evaluate_run(run, passkey=preset.passkey if arm in pk_arms else None, **kw)]
    if arm == SOFTMAX and preset.window:
        out.append(evaluate_run(run, window=train_len, **kw))
    if arm == LSSA:
        out += [evaluate_run(run, attn="lssar", attn_p=q, **kw) for q in preset.eval_reweight]
    return out


def reproduce(
    preset_name: str,
    runs_dir: str | Path | None = None,
    reports_dir: str | Path = "reports",
    progress: bool = True,
    overrides: list[str] | None = None,
) -> Path:
    """Train + evaluate every arm of ``preset_name``; returns the report directory."""
    from lssar.config import load_config, parse_overrides
    from lssar.train import train

    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS[preset_name]
    # Runs are named by the training preset, so presets that share it (quick, cpu) share runs.
    runs_dir = Path(runs_dir or f"runs/reproduce-{preset.train_preset}")
    started = time.time()
    results: list[dict[str, Any]] = []
    for seed in preset.seeds:
        for arm in preset.arms:
            cfg = load_config(
                preset.train_preset,
                {
                    **arm.to_train(),
                    "seed": seed,
                    "out_dir": str(runs_dir),
                    "run_name": _run_name(preset.train_preset, arm, seed),
                    **parse_overrides(overrides or []),
                },
            )
            print(f"== {arm.label} (seed {seed})", flush=True)
            run = train(cfg, resume=True, progress=progress)
            if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 evaluates
                results += evaluate_arm(preset_name, arm, run, cfg.seq_len, progress)
    if int(os.environ.get("RANK", "0")) != 0:
        return Path(reports_dir)
    stamp = dt.date.today().isoformat()
    out = Path(reports_dir) / f"{preset_name}-{stamp}"
    write_report(preset_name, preset, results, out, time.time() - started)
    return out


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="lssar reproduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset", default="quick", help=", ".join(f"{k} ({v.budget})" for k, v in PRESETS.items())
    )
    ap.add_argument("--runs-dir", help="where the runs live (default runs/reproduce-PRESET)")
    ap.add_argument("--reports-dir", default="reports")
    ap.add_argument(
        "--execute",
        action="store_true",
        help="paper preset: run the torchrun commands here instead of printing them",
    )
    args, overrides = ap.parse_known_args(argv)
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose from {', '.join(PRESETS)}")
    if args.preset == "paper" and not args.execute:
        runs = Path(args.runs_dir or f"runs/reproduce-{PRESETS['paper'].train_preset}")
        print(
            f"# {PRESETS['paper'].description}\n# expected time: {PRESETS['paper'].budget}\n"
            "# run these on a GPU node, or there: torchrun --standalone --nproc_per_node=8 "
            "-m lssar reproduce --preset paper --execute\n# (trains every arm in turn, rank 0 "
            "evaluates and writes the report; finished runs are reused)\n"
        )
        print("\n".join(paper_commands(PRESETS["paper"], runs)))
        return 0
    out = reproduce(args.preset, args.runs_dir, args.reports_dir, overrides=overrides)
    print((out / "REPORT.md").read_text())
    print(f"report: {out / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
