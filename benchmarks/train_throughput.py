"""Training step time of a preset's model (tiny-cpu) with softmax, LSSA and LSSAR attention.

Same seed, data and optimizer for every arm; warm-up steps, then timed optimizer steps
(forward, backward, clipping, AdamW), in fp32 and with bf16 autocast. The arms are interleaved
round by round and the median step time is reported, so load from other processes on a shared
machine affects every arm alike (``--clock cpu``: process CPU time, see benchmarks/attention.py).
Prints a Markdown table.

    python benchmarks/train_throughput.py [--seq-len 256] [--steps 8] [--rounds 3]
    python benchmarks/train_throughput.py --threads 1 --clock cpu --dtypes fp32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

import attention as base  # benchmarks/ is on sys.path when run as a script
import numpy as np
import torch
from attention import CLOCKS, machine, set_clock

from lssar.data import get_batch
from lssar.model import GPT
from lssar.train import lr_at
from lssar.train.config import TrainConfig, load_config, model_config


def make_arm(cfg: TrainConfig) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg, 256))
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=False,
    )
    return model, opt


def train_steps(
    model: GPT,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    tokens: np.ndarray,
    start: int,
    n: int,
    bf16: bool,
) -> float:
    """Run optimizer steps ``start .. start+n``; return the seconds they took."""
    t0 = base.clock()
    for step in range(start, start + n):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = get_batch(tokens, step, 0, cfg.batch_size, cfg.seq_len, cfg.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return base.clock() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-cpu", help="model shape and batch")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    ap.add_argument(
        "--attn",
        default="softmax,lssa:cpu,lssa:chunked,lssar:cpu,lssar:chunked",
        help="NAME[:IMPL],... (cpu: the fused C++ kernel auto uses; chunked: the eager path)",
    )
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per arm")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--clock", choices=list(CLOCKS), default="wall", help="wall time or process CPU time"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    set_clock(args.clock)

    tokens = np.random.default_rng(0).integers(0, 256, 1 << 20).astype(np.uint16)
    rows = []
    for dtype in args.dtypes.split(","):
        bf16 = dtype == "bf16"
        arms = {}
        for arm in args.attn.split(","):
            attn, _, impl = arm.partition(":")
            over = {"attn": attn, "attn_impl": impl or "auto", "seq_len": args.seq_len}
            if args.batch_size:
                over["batch_size"] = args.batch_size
            cfg = load_config(args.preset, over)
            model, opt = make_arm(cfg)
            train_steps(model, opt, cfg, tokens, 0, args.warmup, bf16)
            arms[arm] = (cfg, model, opt, [])
        for r in range(args.rounds):
            for cfg, model, opt, times in arms.values():
                start = args.warmup + r * args.steps
                times.append(train_steps(model, opt, cfg, tokens, start, args.steps, bf16))
        base = None
        for attn, (cfg, _, _, times) in arms.items():
            ms = 1000 * statistics.median(times) / args.steps
            base = base or ms
            tok_s = cfg.batch_size * cfg.seq_len / (ms / 1000)
            rows.append((attn, dtype, ms, tok_s, ms / base))

    cfg = load_config(args.preset, {"seq_len": args.seq_len})
    bs = args.batch_size or cfg.batch_size
    print(
        f"{args.preset} model ({cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide), "
        f"T={args.seq_len}, batch {bs}; median of {args.rounds} rounds x {args.steps} steps\n"
        f"Machine: {machine()}\n"
    )
    print("| attention | dtype | step time (ms) | tokens/s | step time / softmax |")
    print("|---|---|---:|---:|---:|")
    for attn, dtype, ms, tok_s, ratio in rows:
        print(f"| {attn} | {dtype} | {ms:.1f} | {tok_s:,.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
