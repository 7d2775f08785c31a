"""Training step time of the tiny-cpu model under the thread settings a user may get.

Each setting runs in a fresh process (OpenMP reads its environment once, at start-up), the
settings interleaved round by round, so load from other processes on a shared machine affects
each alike; the load average at each measurement is printed beside it. Settings: torch's
default (one thread per core, OpenMP's default wait policy: threads spin while they wait), the
same with ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep: what the ``lssar`` command sets
unless the environment says otherwise), and one thread. Prints a Markdown table.

    python benchmarks/threads.py [--attn lssar] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# name -> (what it is, the environment it runs in)
SETTINGS = {
    "torch": ("torch's default: a thread per core, active wait", {}),
    "passive": ("a thread per core, OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "one": ("one thread (OMP_NUM_THREADS=1)", {"OMP_NUM_THREADS": "1"}),
}


def worker(attn: str, steps: int, warmup: int) -> None:
    """Time ``steps`` tiny-cpu training steps in this process; print one JSON line."""
    import torch
    from train_throughput import make_arm, train_steps  # benchmarks/ is on sys.path

    from lssar.train.config import load_config
    from lssar.train.loop import _use_bf16

    cfg = load_config("tiny-cpu", {"attn": attn})
    model, opt = make_arm(cfg)
    tokens = np.random.default_rng(0).integers(0, 256, 1 << 20).astype(np.uint16)
    bf16 = _use_bf16(cfg.dtype, torch.device("cpu"))
    train_steps(model, opt, cfg, tokens, 0, warmup, bf16)
    load = os.getloadavg()[0]
    dt = train_steps(model, opt, cfg, tokens, warmup, steps, bf16)
    print(json.dumps({"s_per_step": dt / steps, "threads": torch.get_num_threads(), "load": load}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn", default="lssar")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.attn, args.steps, args.warmup)
        return
    names = args.settings.split(",")
    rows: dict[str, list[dict]] = {n: [] for n in names}
    unset = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    for r in range(args.rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--worker", "--attn", args.attn]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            t0 = time.time()
            out = subprocess.run(
                cmd, env={**base, **SETTINGS[name][1]}, capture_output=True, text=True, check=True
            )
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            rows[name].append(rec)
            print(
                f"round {r} {SETTINGS[name][0]}: {rec['s_per_step']:.3f} s/step, "
                f"{rec['threads']} threads, load {rec['load']:.1f} ({time.time() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    print(f"\n{args.attn}, tiny-cpu, {args.steps} steps per round, {os.cpu_count()} cores\n")
    print("| setting | threads | s/step (median) | each round | load average |")
    print("|---|---|---|---|---|")
    for name in names:
        recs = rows[name]
        each = ", ".join(f"{x['s_per_step']:.2f}" for x in recs)
        loads = ", ".join(f"{x['load']:.1f}" for x in recs)
        med = statistics.median(x["s_per_step"] for x in recs)
        print(f"| {SETTINGS[name][0]} | {recs[0]['threads']} | {med:.3f} | {each} | {loads} |")


if __name__ == "__main__":
    main()
