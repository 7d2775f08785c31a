"""Train a small GPT with LSSAR attention and evaluate it at 1x to 16x its training length.

    python examples/train_and_evaluate.py                  # the tiny-cpu preset: 450 steps
    python examples/train_and_evaluate.py --steps 20 --lengths 1,2 --tokens 2048   # toy size

The same as ``lssar train --preset tiny-cpu --attn=lssar`` then ``lssar eval RUN``, from Python:
the run directory (config, log, checkpoints) is written under ``--out``; running again resumes
or, when finished, reuses the run and its evaluation.
"""

from __future__ import annotations

import argparse

from lssar.studies.lm.evaluate import evaluate_run
from lssar.train import load_run, train
from lssar.train.config import load_config, parse_overrides


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs", help="where the run directory goes")
    ap.add_argument("--steps", type=int, help="training steps (default: the preset's 450)")
    ap.add_argument("--lengths", default="1,2,4,8,16", help="multiples of the training length")
    ap.add_argument("--tokens", type=int, default=16384, help="validation tokens per length")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)

    overrides = {"attn": "lssar", "attn_p": 15.0, "out_dir": args.out, "run_name": "example-lssar"}
    if args.steps is not None:  # a shorter run: validate and checkpoint at its end
        overrides |= {"max_steps": args.steps, "eval_every": args.steps, "ckpt_every": args.steps}
        overrides |= {"warmup_steps": min(50, args.steps // 2)}
    cfg = load_config("tiny-cpu", {**overrides, **parse_overrides(args.set)})
    run = train(cfg)  # prepares the embedded Shakespeare corpus on first use

    model, cfg, meta = load_run(run)
    val = meta["val_history"][-1][1]
    print(f"{run}: {cfg.attn} p={cfg.attn_p}, {meta['step']} steps, validation loss {val:.3f}")
    multiples = [int(m) for m in args.lengths.split(",")]
    result = evaluate_run(run, multiples=multiples, eval_tokens=args.tokens, diagnostics=False)
    for length, loss in result["loss"].items():
        print(f"loss at {int(length) // cfg.seq_len:>2}x ({length} tokens): {loss:.3f}")


if __name__ == "__main__":
    main()
