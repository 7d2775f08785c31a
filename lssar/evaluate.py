"""Length extrapolation: loss vs length, passkey retrieval, attention diagnostics, numerics.

``lssar eval RUN`` evaluates a trained run at multiples of its training length (default 1x..16x)
on the same budget of validation tokens at every length, with the memory-efficient kernels, and
optionally with another attention rule than the one trained (``--attn lssar --attn-p 15`` on an
LSSA-trained model is the paper's fine-tuning-free re-weighting; the switch follows
:meth:`lssar.spec.AttentionSpec.override`, as in ``lssar sample`` and ``lssar lm-eval``: the
trained impl is kept where it runs the new rule). Writes ``eval/<tag>/`` in the run directory:
``results.json``, ``results.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lssar.data import get_tokenizer, iter_eval_windows, load_split
from lssar.model import GPT
from lssar.runio import atomic_write
from lssar.spec import AttentionSpec, run_label

DEFAULT_MULTIPLES = (1, 2, 4, 8, 16)
TOKENS_PER_BATCH = 8192  # rows per forward = this // length (memory stays flat across lengths)
N_POSITION_BUCKETS = 32


def parse_multiples(text: str | list[int] | tuple[int, ...]) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; every entry a positive integer."""
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        out = [int(x) for x in items]
    except ValueError:
        raise ValueError(
            f"lengths must be positive integers like 1,2,4,8,16; got {text!r}"
        ) from None
    if not out or any(m < 1 for m in out):
        raise ValueError(
            f"lengths must be positive integer multiples of the training length, got {text!r}"
        )
    return sorted(set(out))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


@torch.inference_mode()
def loss_vs_length(
    model: GPT,
    val: np.ndarray,
    train_len: int,
    multiples: list[int],
    eval_tokens: int,
    progress: bool = True,
) -> dict[str, Any]:
    """Mean next-token loss at each length ``m * train_len`` over the same ``eval_tokens`` budget.

    Also the loss by position inside the longest window (``N_POSITION_BUCKETS`` buckets), which
    shows where a model starts to fail.
    """
    longest = max(multiples) * train_len
    budget = (eval_tokens // longest) * longest  # a whole number of windows at every length
    if budget == 0:
        raise ValueError(
            f"eval_tokens={eval_tokens} is below the longest length {longest}; "
            f"use --tokens >= {longest}"
        )
    if len(val) < budget + 1:
        raise ValueError(
            f"the validation split has {len(val)} tokens; {budget + 1} are needed to score "
            f"{budget} tokens at length {longest}: lower --tokens or the longest length"
        )
    losses, per_position = {}, None
    bar = tqdm(multiples, desc="loss vs length", disable=not progress, leave=False)
    for m in bar:
        t = m * train_len
        total, count = 0.0, 0
        pos_sum = torch.zeros(t, dtype=torch.float64)
        for x, y in iter_eval_windows(val, t, budget, batch_size=max(1, TOKENS_PER_BATCH // t)):
            _, loss = model(x, y, reduction="none")  # (B, T)
            total += loss.double().sum().item()
            count += loss.numel()
            pos_sum += loss.double().sum(0)
        losses[t] = total / count
        if t == longest:
            per_position = (
                (pos_sum / (count // t)).view(N_POSITION_BUCKETS, -1).mean(1).tolist()
                if t % N_POSITION_BUCKETS == 0
                else (pos_sum / (count // t)).tolist()
            )
    return {
        "train_len": train_len,
        "tokens_per_length": budget,
        "loss": {str(k): v for k, v in losses.items()},
        "loss_by_position": per_position,
    }


@torch.inference_mode()
def attention_diagnostics(model: GPT, val: np.ndarray, lengths: list[int]) -> dict[str, Any]:
    """Per length and layer: mean row entropy (nats) and mean attention mass on the first token.

    Uses one window of each length from the start of the validation split and the materialised
    weights (the reference path), so keep the lengths moderate.
    """
    out: dict[str, Any] = {}
    for t in lengths:
        x, _ = next(iter_eval_windows(val, t, t))
        weights: list[torch.Tensor] = []
        model(x, weights=weights)
        ent, sink = [], []
        for w in weights:  # (1, H, T, T)
            ent.append(float(-(w * torch.log(w.clamp_min(1e-30))).sum(-1).mean()))
            sink.append(float(w[..., 0].mean()))
        out[str(t)] = {"entropy": ent, "sink": sink}
    return out


def numerical_health(model: GPT, val: np.ndarray, length: int) -> dict[str, Any]:
    """bf16/fp16 autocast at ``length`` vs a float64 run: non-finite logits and loss error."""
    x, y = next(iter_eval_windows(val, length, length))
    model64 = copy.deepcopy(model).double()
    with torch.inference_mode():
        _, ref = model64(x, y)
        result: dict[str, Any] = {"length": length, "loss_fp64": float(ref)}
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            with torch.autocast("cpu" if x.device.type == "cpu" else "cuda", dtype=dtype):
                logits, loss = model(x, y)
            result[name] = {
                "nonfinite_logits": int((~torch.isfinite(logits)).sum()),
                "loss": float(loss),
                "abs_error_vs_fp64": abs(float(loss) - float(ref)),
            }
    return result


# --------------------------------------------------------------------------------- passkey

KEY_TEMPLATE = " The pass key is {key}. Remember it. "
QUESTION = " What is the pass key? The pass key is "


def passkey_probe(
    tok,
    filler: Sequence[int] | np.ndarray,
    length: int,
    key: str,
    place: Callable[[int], tuple[int, int]],
    question: str = QUESTION,
    answer: str | None = None,
) -> tuple[list[int], list[int]]:
    """The one passkey probe builder (evaluation and the lm-eval task): (context ids, answer ids).

    ``n_fill`` filler tokens (real text) from ``filler[start:]`` with ``KEY_TEMPLATE`` inserted
    after ``cut`` of them, then ``question``; ``place(n_fill)`` chooses ``(start, cut)``. The
    context plus the answer (``answer``, default ``key``) is exactly ``length`` tokens.
    """
    key_ids = tok.encode(KEY_TEMPLATE.format(key=key))
    q_ids, ans = tok.encode(question), tok.encode(key if answer is None else answer)
    probe = len(key_ids) + len(q_ids) + len(ans)
    n_fill = length - probe
    if n_fill < 0:
        raise ValueError(
            f"length {length} is too short for a passkey probe: it does not fit the probe "
            f"({probe} tokens without filler)"
        )
    if n_fill >= len(filler):
        raise ValueError(f"passkey length {length} needs more filler text than the held-out text")
    start, cut = place(n_fill)
    fill = np.asarray(filler[start : start + n_fill]).tolist()
    return fill[:cut] + key_ids + fill[cut:] + q_ids, ans


def passkey_sample(
    tok, filler: np.ndarray, length: int, depth: float, key: str, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Token ids of one probe of exactly ``length`` tokens and where the answer starts.

    Filler text (real corpus tokens) surrounds ``KEY_TEMPLATE`` placed at relative ``depth``;
    the sequence ends with ``QUESTION`` followed by the key's tokens (the answer).
    """

    def place(n_fill: int) -> tuple[int, int]:
        return int(rng.integers(0, len(filler) - n_fill)), int(round(depth * n_fill))

    context, ans = passkey_probe(tok, filler, length, key, place)
    return context + ans, len(context)


def _passkey_batch(tok, filler, length, n, rng, depth=None):
    seqs, starts = [], []
    for _ in range(n):
        key = str(int(rng.integers(10000, 100000)))
        d = float(rng.uniform(0, 1)) if depth is None else depth
        ids, a = passkey_sample(tok, filler, length, d, key, rng)
        seqs.append(ids)
        starts.append(a)
    x = torch.tensor(seqs, dtype=torch.long)
    return x, starts


def passkey_finetune(
    model: GPT,
    tok,
    filler: np.ndarray,
    length: int,
    steps: int,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> GPT:
    """Briefly fine-tune a copy of ``model`` on passkey probes at the training length.

    The loss is on the answer tokens only; keys and depths are random.
    """
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    for _ in tqdm(range(steps), desc="passkey fine-tune", disable=not progress, leave=False):
        x, starts = _passkey_batch(tok, filler, length, batch_size, rng)
        logits, _ = model(x[:, :-1])
        mask = torch.zeros_like(x[:, 1:], dtype=torch.bool)
        for i, a in enumerate(starts):
            mask[i, a - 1 :] = True
        loss = F.cross_entropy(logits.float()[mask], x[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


@torch.inference_mode()
def passkey_accuracy(
    model: GPT,
    tok,
    filler: np.ndarray,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int = 1,
) -> dict[str, Any]:
    """Greedy exact-match accuracy of the key, per length and depth."""
    rng = np.random.default_rng(seed)
    acc: dict[str, dict[str, float]] = {}
    for t in lengths:
        acc[str(t)] = {}
        for d in depths:
            x, starts = _passkey_batch(tok, filler, t, trials, rng, depth=d)
            hits = 0
            for i in range(trials):  # one probe per forward keeps memory flat at long lengths
                logits, _ = model(x[i : i + 1, :-1])
                pred = logits[0, starts[i] - 1 :].argmax(-1)
                hits += bool(torch.equal(pred, x[i, starts[i] :]))
            acc[str(t)][f"{d:g}"] = hits / trials
    return acc


# ------------------------------------------------------------------------------ run-level


def evaluate_run(
    run_dir: str | Path,
    multiples: list[int] | None = None,
    attn: str | None = None,
    attn_p: float | None = None,
    eval_tokens: int = 65536,
    diagnostics: bool = True,
    health: bool = True,
    passkey: bool = False,
    passkey_steps: int = 300,
    passkey_trials: int = 10,
    tag: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate a run; writes ``RUN/eval/<tag>/results.json`` (+ .md, plots) and returns it.

    ``attn`` / ``attn_p`` switch the trained attention by :meth:`AttentionSpec.override`; the
    default ``tag`` is the evaluated rule's slug (``lssar_p15``). Re-running with the same
    arguments reuses the saved result.
    """
    from lssar.runs import load_run

    run_dir = Path(run_dir)
    multiples = parse_multiples(multiples or list(DEFAULT_MULTIPLES))
    model, cfg, meta = load_run(run_dir)
    trained = cfg.attention.label
    try:
        model.set_attention(model.attn_spec.override(attn, p=attn_p))
    except ValueError as e:
        what = f"{attn or cfg.attn!r}" + ("" if attn_p is None else f" p={attn_p:g}")
        raise ValueError(f"cannot evaluate this run with attention {what}: {e}") from None
    evaluated = model.attn_spec.label
    tag = tag or model.attn_spec.slug("_")
    out_dir = run_dir / "eval" / tag
    settings = {
        "multiples": multiples,
        "eval_tokens": eval_tokens,
        "diagnostics": diagnostics,
        "health": health,
        "passkey": passkey,
        "passkey_steps": passkey_steps,
        "passkey_trials": passkey_trials,
    }
    cached = out_dir / "results.json"
    if cached.exists():
        prev = json.loads(cached.read_text())
        if prev.get("settings") == settings and prev.get("step") == meta.get("step"):
            return prev
    val = load_split(meta["data_dir"], "val")
    train_len = cfg.seq_len
    lengths = [m * train_len for m in multiples]
    result: dict[str, Any] = {
        "run": str(run_dir),
        "trained_attention": trained,
        "evaluated_attention": evaluated,
        "step": meta.get("step"),
        "config": dataclasses.asdict(cfg),
        "settings": settings,
        "env": _read_json(run_dir / "env.json"),
    }
    result.update(loss_vs_length(model, val, train_len, multiples, eval_tokens, progress))
    if diagnostics:
        result["diagnostics"] = attention_diagnostics(model, val, lengths)
    if health:
        result["numerical_health"] = numerical_health(model, val, lengths[-1])
    if passkey:
        tok = get_tokenizer(cfg.tokenizer, corpus_dir=meta["data_dir"])
        train_tokens = load_split(meta["data_dir"], "train")
        tuned = passkey_finetune(
            model, tok, train_tokens, train_len, passkey_steps, seed=cfg.seed, progress=progress
        )
        result["passkey"] = passkey_accuracy(
            tuned, tok, val, lengths, [0.1, 0.5, 0.9], passkey_trials
        )
    atomic_write(out_dir / "results.md", results_markdown(result))
    plot_results([result], out_dir)
    atomic_write(cached, json.dumps(result, indent=1))
    return result


def results_markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# Evaluation of {r['run']}",
        "",
        f"Trained with **{r['trained_attention']}**, evaluated with "
        f"**{r['evaluated_attention']}** at step {r['step']}; "
        f"{r['tokens_per_length']} validation tokens per length.",
        "",
        "| length | x train | val loss |",
        "|---|---|---|",
    ]
    for t, loss in r["loss"].items():
        lines.append(f"| {t} | {int(t) // r['train_len']} | {loss:.4f} |")
    if "diagnostics" in r:
        lines += ["", "| length | mean entropy (nats) | mean first-token mass |", "|---|---|---|"]
        for t, d in r["diagnostics"].items():
            lines.append(f"| {t} | {np.mean(d['entropy']):.3f} | {np.mean(d['sink']):.3f} |")
    if "numerical_health" in r:
        h = r["numerical_health"]
        lines += [
            "",
            f"Numerical health at length {h['length']} (fp64 loss {h['loss_fp64']:.4f}):",
            "",
        ] + [
            f"- {k}: {h[k]['nonfinite_logits']} non-finite logits, |loss error| "
            f"{h[k]['abs_error_vs_fp64']:.2e}"
            for k in ("bf16", "fp16")
        ]
    if "passkey" in r:
        depths = list(next(iter(r["passkey"].values())))
        lines += [
            "",
            "| length | " + " | ".join(f"depth {d}" for d in depths) + " |",
            "|---" * (len(depths) + 1) + "|",
        ]
        for t, row in r["passkey"].items():
            lines.append(f"| {t} | " + " | ".join(f"{row[d]:.0%}" for d in depths) + " |")
    return "\n".join(lines) + "\n"


def plot_results(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Loss vs length, loss by position, entropy/sink vs length, passkey heat-maps (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        xs = [int(t) / r["train_len"] for t in r["loss"]]
        ax.plot(xs, list(r["loss"].values()), marker="o", label=label_of(r))
    ax.set(
        xscale="log",
        xlabel="evaluation length / training length",
        ylabel="validation loss",
        title="Loss vs length",
    )
    ax.set_xticks(xs, [f"{x:g}x" for x in xs])
    ax.legend(fontsize=8)
    save(fig, "loss_vs_length.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        pp = r["loss_by_position"]
        longest = max(int(t) for t in r["loss"])
        ax.plot(
            np.linspace(0, longest, len(pp), endpoint=False) / r["train_len"], pp, label=label_of(r)
        )
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="position / training length", ylabel="loss", title="Loss by position")
    ax.legend(fontsize=8)
    save(fig, "loss_by_position.png")

    if all("diagnostics" in r for r in results):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for r in results:
            ts = [int(t) / r["train_len"] for t in r["diagnostics"]]
            d = r["diagnostics"].values()
            axes[0].plot(ts, [np.mean(x["entropy"]) for x in d], marker="o", label=label_of(r))
            axes[1].plot(ts, [np.mean(x["sink"]) for x in d], marker="o", label=label_of(r))
        axes[0].set(xscale="log", xlabel="length / training length", ylabel="mean row entropy")
        axes[1].set(
            xscale="log", xlabel="length / training length", ylabel="attention mass on token 0"
        )
        axes[0].legend(fontsize=8)
        save(fig, "entropy_sink_vs_length.png")

    with_pk = [r for r in results if "passkey" in r]
    if with_pk:
        fig, axes = plt.subplots(1, len(with_pk), figsize=(3.2 * len(with_pk), 3), squeeze=False)
        for ax, r in zip(axes[0], with_pk):
            rows = list(r["passkey"])
            depths = list(r["passkey"][rows[0]])
            grid = np.array([[r["passkey"][t][d] for d in depths] for t in rows])
            ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(depths)), depths)
            ax.set_yticks(range(len(rows)), [f"{int(t) // r['train_len']}x" for t in rows])
            ax.set(title=label_of(r), xlabel="depth")
        save(fig, "passkey.png")
    return paths


def label_of(r: dict[str, Any]) -> str:
    """The result's attention label (:func:`lssar.spec.run_label`)."""
    return run_label(r["trained_attention"], r["evaluated_attention"])


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="lssar eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run", help="run directory (from lssar train)")
    ap.add_argument(
        "--lengths", default="1,2,4,8,16", help="multiples of the training length, e.g. 1,2,4,8,16"
    )
    ap.add_argument("--attn", help="evaluate with this attention instead of the trained one")
    ap.add_argument("--attn-p", type=float, help="re-weighting power for the evaluation")
    ap.add_argument("--tokens", type=int, default=65536, help="validation tokens per length")
    ap.add_argument("--passkey", action="store_true", help="also fine-tune and test passkey")
    ap.add_argument("--passkey-steps", type=int, default=300)
    ap.add_argument("--no-diagnostics", action="store_true")
    ap.add_argument("--tag", help="name of the output folder under RUN/eval/")
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist; train one with lssar train")
    r = evaluate_run(
        run,
        parse_multiples(args.lengths),
        args.attn,
        args.attn_p,
        args.tokens,
        diagnostics=not args.no_diagnostics,
        health=not args.no_diagnostics,
        passkey=args.passkey,
        passkey_steps=args.passkey_steps,
        tag=args.tag,
    )
    print(results_markdown(r))
    spec = AttentionSpec.from_config(r["config"]).override(args.attn, p=args.attn_p)
    tag = args.tag or spec.slug("_")
    print(f"saved to {run / 'eval' / tag}")
    return 0
