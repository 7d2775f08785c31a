"""Length extrapolation: loss vs length, passkey retrieval, attention diagnostics, numerics.

``lssar eval RUN`` evaluates a trained run at multiples of its training length (default 1x..16x)
on the same budget of validation tokens at every length, with the memory-efficient kernels, and
optionally with another attention rule than the one trained (``--attn lssar --attn-p 15`` on an
LSSA-trained model is the paper's fine-tuning-free re-weighting; the switch follows
:meth:`lssar.spec.AttentionSpec.override`, as in ``lssar sample`` and ``lssar lm-eval``: the
trained impl is kept where it runs the new rule), and a RoPE model with its rotation rescaled
(``--rope-scaling yarn --rope-factor auto``: PI, NTK, dynamic NTK or YaRN, see
:mod:`lssar.positions`; ``auto`` = the evaluated length over the training length, at each
length). Both go through :meth:`lssar.model.GPT.switch`. Writes ``eval/<tag>/`` in the run
directory: ``results.json``, ``results.md`` and PNG plots.

Whether the keys beyond the training length L are used is measured beside every result (unless
``--no-context``), with the model-agnostic probes of :mod:`lssar.studies.lm.context`:

- ``own_window``: the same model on the same windows with every query limited to its own last L
  keys, at every length past L (``loss``, ``loss_by_position``, and its copy probe): paired by
  window with the full-context score, so full - own window < 0 says the far keys lower the loss;
- ``copy``: the copy probe at distances 2L .. 16L (a segment, other held-out text, the segment
  again: the loss on the second copy against the first), with the result's own attention span;
  ``own_window.copy`` is the same probes with the L-key window, which cannot see the first copy.

One module (~690 lines): one command's job, ``lssar eval``: the measurements, the cache key over
their settings, their tables and the options that name the same settings (the probes' own
code is in :mod:`lssar.studies.lm.context` and :mod:`lssar.studies.lm.passkey`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lssar import clihelp
from lssar.data import get_tokenizer, iter_eval_windows, load_split, read_manifest
from lssar.data.manifest import manifest_files
from lssar.model import GPT
from lssar.ops import VARIANTS
from lssar.positions import ROPE_SCALINGS, with_pos
from lssar.runio import atomic_write, child_path, environment
from lssar.studies.common import code_digest
from lssar.studies.labels import label_of
from lssar.studies.lm.context import COPY_SEGMENT, copy_probe
from lssar.studies.lm.figures import plot_results
from lssar.studies.lm.passkey import (
    PASSKEY_DEPTHS,
    PasskeySettings,
    passkey_finetune,
    passkey_scores,
)

DEFAULT_MULTIPLES = (1, 2, 4, 8, 16)
TOKENS_PER_BATCH = 8192  # rows per forward = this // length (memory stays flat across lengths)
N_POSITION_BUCKETS = 32
COPY_PROBES = 16  # copy-probe sequences per distance (the same ones for every arm and seed)
# what an evaluation's numbers depend on besides the run: a change here recomputes cached results
_EVAL_SOURCES = (
    "studies/lm/evaluate.py",
    "studies/lm/context.py",
    "studies/lm/passkey.py",
    "model.py",
    "positions.py",
    "spec.py",
    "data/batches.py",
    "data/passkey.py",
    "ops",
)


def eval_code_version() -> str:
    """A digest of the evaluation code (:data:`_EVAL_SOURCES`), stored with every evaluation; a
    cached evaluation made by other code is recomputed."""
    return code_digest(_EVAL_SOURCES)


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
    window: int | None = None,
) -> dict[str, Any]:
    """Mean next-token loss at each length ``m * train_len`` over the same ``eval_tokens`` budget,
    from windows spread evenly over the split (:func:`lssar.data.eval_starts`); ``window`` limits
    attention to that many keys.

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
            _, loss = model(x, y, reduction="none", window=window)  # (B, T)
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
        "windows_per_length": {str(m * train_len): budget // (m * train_len) for m in multiples},
        "loss": {str(k): v for k, v in losses.items()},
        "loss_by_position": per_position,
    }


N_ROW_BINS = 16  # row-position bins of the diagnostics' profile along the window


def _row_bins(t: int) -> list[tuple[int, int]]:
    """``[start, end)`` of up to :data:`N_ROW_BINS` equal runs of rows of a length-``t`` window."""
    edges = np.linspace(0, t, min(N_ROW_BINS, t) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@torch.inference_mode()
def attention_diagnostics(
    model: GPT,
    val: np.ndarray,
    lengths: list[int],
    n_windows: int = 8,
    window: int | None = None,
    train_len: int | None = None,
) -> dict[str, Any]:
    """Per length: mean row entropy (nats) and mean attention mass on the first token, averaged
    over ``n_windows`` windows spread over the split, beside what uniform attention over the
    same visible keys gives (``uniform_entropy`` = mean ln N_i, ``uniform_sink`` = mean 1/N_i):
    a sink has formed only where the first-token mass is above the uniform one.

    A mean over every row is dominated by the early rows (a 16x window has 15 rows beyond the
    training length for every row within it, yet the row mean hides how those late rows
    behave), so besides the per-layer means over all rows (``entropy``, ``sink``) it gives
    them over the rows beyond ``train_len`` (default: the shortest length; ``entropy_beyond``,
    ``sink_beyond`` and their uniform values; None when no row is beyond) and a profile along
    the window (``row_bins``: ``[start, end)`` rows; ``entropy_by_row``, ``sink_by_row`` and
    their uniform values, each a mean over layers, heads, windows and the bin's rows).

    Uses the materialised weights (the reference path), one window per forward, so keep the
    lengths moderate.
    """
    limit = min(lengths) if train_len is None else train_len
    n_layer = model.cfg.n_layer
    out: dict[str, Any] = {}
    for t in lengths:
        n_i = torch.arange(1, t + 1, dtype=torch.float64)  # (T,) keys each row sees
        if window is not None:
            n_i = n_i.clamp(max=window)
        sees_first = torch.arange(t) < (t if window is None else window)  # (T,) key 0 visible
        u_ent, u_sink = n_i.log(), sees_first / n_i  # (T,) uniform attention's values
        beyond = torch.arange(t) >= limit  # (T,) rows past the training length
        ent, sink = np.zeros((n_layer, t)), np.zeros((n_layer, t))  # summed over windows
        count = 0
        for x, _ in iter_eval_windows(val, t, n_windows * t):
            weights: list[torch.Tensor] = []
            model(x, weights=weights, window=window)
            for i, w in enumerate(weights):  # (1, H, T, T)
                row_ent = -(w * torch.log(w.clamp_min(1e-30))).sum(-1)  # (1, H, T)
                ent[i] += row_ent.mean((0, 1)).double().numpy()
                sink[i] += w[..., 0].mean((0, 1)).double().numpy()
            count += 1
        ent, sink = ent / count, sink / count  # (L, T) per layer and row
        far = beyond.numpy()
        bins = _row_bins(t)
        out[str(t)] = {
            "entropy": ent.mean(1).tolist(),
            "sink": sink.mean(1).tolist(),
            "windows": count,
            "uniform_entropy": float(u_ent.mean()),
            "uniform_sink": float(u_sink.mean()),
            "entropy_beyond": ent[:, far].mean(1).tolist() if far.any() else None,
            "sink_beyond": sink[:, far].mean(1).tolist() if far.any() else None,
            "uniform_entropy_beyond": float(u_ent[beyond].mean()) if far.any() else None,
            "uniform_sink_beyond": float(u_sink[beyond].mean()) if far.any() else None,
            "row_bins": [list(b) for b in bins],
            "entropy_by_row": [float(ent[:, a:b].mean()) for a, b in bins],
            "sink_by_row": [float(sink[:, a:b].mean()) for a, b in bins],
            "uniform_entropy_by_row": [float(u_ent[a:b].mean()) for a, b in bins],
            "uniform_sink_by_row": [float(u_sink[a:b].mean()) for a, b in bins],
        }
    return out


def numerical_health(
    model: GPT, val: np.ndarray, length: int, window: int | None = None
) -> dict[str, Any]:
    """bf16/fp16 autocast at ``length`` vs a float64 run: non-finite logits and loss error."""
    x, y = next(iter_eval_windows(val, length, length))
    model64 = copy.deepcopy(model).double()
    with torch.inference_mode():
        _, ref = model64(x, y, window=window)
        result: dict[str, Any] = {"length": length, "loss_fp64": float(ref)}
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            with torch.autocast("cpu" if x.device.type == "cpu" else "cuda", dtype=dtype):
                logits, loss = model(x, y, window=window)
            result[name] = {
                "nonfinite_logits": int((~torch.isfinite(logits)).sum()),
                "loss": float(loss),
                "abs_error_vs_fp64": abs(float(loss) - float(ref)),
            }
    return result


def _rows_at_a_time(model: GPT, tokens: int = TOKENS_PER_BATCH):
    """``model``'s evaluation call, run on at most ``tokens`` tokens at a time (whole rows), so a
    batch of long copy probes stays within the memory of one loss-vs-length batch."""

    def forward(x: torch.Tensor, y: torch.Tensor, reduction: str = "none", window=None):
        rows = max(1, tokens // x.shape[1])
        parts = [
            model(x[i : i + rows], y[i : i + rows], reduction=reduction, window=window)[1]
            for i in range(0, len(x), rows)
        ]
        return None, torch.cat(parts)

    return forward


def copy_distances(train_len: int, multiples: list[int]) -> list[int]:
    """The copy probe's distances: every evaluated length past the training length (2L .. 16L
    by default)."""
    return [m * train_len for m in multiples if m > 1]


@torch.inference_mode()
def context_use(
    model: GPT,
    val: np.ndarray,
    train_len: int,
    multiples: list[int],
    eval_tokens: int,
    window: int | None = None,
    copy_probes: int = COPY_PROBES,
    progress: bool = True,
) -> dict[str, Any]:
    """Whether ``model`` uses the keys beyond ``train_len`` (the module docstring):
    ``{"copy": the copy probe with the result's own span (``window``), "own_window": {"window":
    L, "loss" and "loss_by_position" at the lengths past L on the windows
    :func:`loss_vs_length` scores, "copy": the copy probe with the L-key window}}``.
    ``own_window`` is left out when the result already sees at most L keys (``window <= L``:
    the window control), ``copy`` when no length is past L."""
    out: dict[str, Any] = {}
    distances = copy_distances(train_len, multiples)
    if not distances:
        return out
    probe = dict(n=copy_probes, segment=min(COPY_SEGMENT, train_len), seed=0, progress=progress)
    lm = _rows_at_a_time(model)
    out["copy"] = copy_probe(lm, val, distances, window=window, **probe)
    if window is None or window > train_len:
        past = [m for m in multiples if m > 1]
        own = loss_vs_length(model, val, train_len, past, eval_tokens, progress, train_len)
        out["own_window"] = {
            "window": train_len,
            "loss": own["loss"],
            "loss_by_position": own["loss_by_position"],
            "copy": copy_probe(lm, val, distances, window=train_len, **probe),
        }
    return out


# ------------------------------------------------------------------------------ run-level


def cache_key(cfg: Any, meta: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """What a cached evaluation must match to be reused: the checkpoint's content (its sha256:
    a run retrained with ``--no-resume`` and another seed or lr at the same step is another
    model), the run's config, the dataset's files (their manifest sha256, which
    :func:`lssar.data.load_split` verifies), the evaluation settings and code."""
    from lssar.train.checkpoint import file_sha256

    m = read_manifest(meta["data_dir"])
    return json.loads(  # the JSON form, as it is stored and read back
        json.dumps(
            {
                "checkpoint_sha256": file_sha256(meta["checkpoint"]),
                "config": dataclasses.asdict(cfg),
                "data": manifest_files(m),
                "settings": settings,
                "eval_version": eval_code_version(),
            }
        )
    )


def evaluate_run(
    run_dir: str | Path,
    multiples: list[int] | None = None,
    attn: str | None = None,
    attn_p: float | None = None,
    eval_tokens: int = 65536,
    diagnostics: bool = True,
    health: bool = True,
    passkey: PasskeySettings | None = None,
    window: int | None = None,
    diagnostic_windows: int = 8,
    tag: str | None = None,
    progress: bool = True,
    folder: str = "",
    rope_scaling: str | None = None,
    rope_factor: Any = None,
    context: bool = True,
    copy_probes: int = COPY_PROBES,
) -> dict[str, Any]:
    """Evaluate a run; writes ``RUN/eval/[<folder>/]<tag>/results.json`` (+ .md, plots) and
    returns it (``folder`` keeps the evaluations of different studies of one run apart).

    ``attn`` / ``attn_p`` switch the trained attention by :meth:`AttentionSpec.override`;
    ``window`` limits every query to its last ``window`` keys (the sliding-window control);
    ``rope_scaling`` / ``rope_factor`` rescale a RoPE model's rotation (:meth:`GPT.switch`);
    ``context`` adds the own-window control and the copy probe (:func:`context_use`, with
    ``copy_probes`` sequences per distance). The
    default ``tag`` is the evaluated rule's slug (``lssar_p15``, ``softmax_window128``,
    ``softmax_yarn_auto``).
    Re-running with the same arguments reuses the saved result only while :func:`cache_key`
    matches: the same checkpoint content, run config, data, settings and evaluation code.
    Every result records the run's environment (``env``: the training commit) and its own
    (``eval_env``).
    """
    from lssar.train.runs import load_run

    run_dir = Path(run_dir)
    multiples = parse_multiples(multiples or list(DEFAULT_MULTIPLES))
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    if context and copy_probes < 1:
        raise ValueError(f"--copy-probes must be at least 1, got {copy_probes}")
    model, cfg, meta = load_run(run_dir)
    trained = with_pos(cfg.attention.label, cfg.pos)
    try:
        model.switch(attn, attn_p, rope_scaling, rope_factor, cfg.seq_len)
    except ValueError as e:
        what = f"{attn or cfg.attn!r}" + ("" if attn_p is None else f" p={attn_p:g}")
        if rope_scaling is not None:
            what += f" and --rope-scaling {rope_scaling}"
        raise ValueError(f"cannot evaluate this run with attention {what}: {e}") from None
    evaluated = with_pos(model.attn_spec.label, cfg.pos)
    rope = model.rope_scaling
    tag = tag or (
        model.attn_spec.slug("_")
        + ("" if rope is None else f"_{rope.slug()}")
        + ("" if window is None else f"_window{window}")
    )
    out_dir = child_path(run_dir / "eval", folder, "folder") if folder else run_dir / "eval"
    out_dir = child_path(out_dir, tag, "--tag")
    settings = {
        "multiples": multiples,
        "eval_tokens": eval_tokens,
        "diagnostics": diagnostics,
        "diagnostic_windows": diagnostic_windows,
        "health": health,
        "passkey": None if passkey is None else dataclasses.asdict(passkey),
        "window": window,
        "rope_scaling": None if rope is None else rope.label,
        "context": context,
        "copy_probes": copy_probes if context else None,
    }
    key = cache_key(cfg, meta, settings)
    cached = out_dir / "results.json"
    if cached.exists():
        try:
            prev = json.loads(cached.read_text())
        except ValueError:  # a damaged cache is recomputed, never trusted
            prev = {}
        if isinstance(prev, dict) and prev.get("cache_key") == key:
            return prev
    val = load_split(meta["data_dir"], "val")
    train_len = cfg.seq_len
    lengths = [m * train_len for m in multiples]
    result: dict[str, Any] = {
        "run": str(run_dir),
        "trained_attention": trained,
        "evaluated_attention": evaluated,
        "rope_scaling": None if rope is None else rope.label,
        "window": window,
        "tag": tag,
        "folder": folder,  # the result lives in RUN/eval/<folder>/<tag>
        "step": meta.get("step"),
        "config": dataclasses.asdict(cfg),
        "settings": settings,
        "eval_version": eval_code_version(),
        "cache_key": key,
        "env": _read_json(run_dir / "env.json"),
        "eval_env": environment(),
    }
    result.update(loss_vs_length(model, val, train_len, multiples, eval_tokens, progress, window))
    if context:
        result.update(
            context_use(
                model, val, train_len, multiples, eval_tokens, window, copy_probes, progress
            )
        )
    if diagnostics:
        result["diagnostics"] = attention_diagnostics(
            model, val, lengths, diagnostic_windows, window, train_len
        )
    if health:
        result["numerical_health"] = numerical_health(model, val, lengths[-1], window)
    if passkey is not None:
        tok = get_tokenizer(cfg.tokenizer, corpus_dir=meta["data_dir"])
        train_tokens = load_split(meta["data_dir"], "train")
        tuned, fit = passkey_finetune(
            model, tok, train_tokens, train_len, passkey, seed=cfg.seed, progress=progress
        )
        result["passkey"] = {
            **fit,
            **passkey_scores(
                tuned,
                tok,
                val,
                lengths,
                list(PASSKEY_DEPTHS),
                passkey.trials,
                digits=passkey.digits,
                window=window,
                train_len=train_len,
            ),
        }
    atomic_write(out_dir / "results.md", results_markdown(result))
    plot_results([result], out_dir)
    atomic_write(cached, json.dumps(result, indent=1))
    return result


def _context_markdown(r: dict[str, Any]) -> list[str]:
    """The own-window control and the copy probe of one result (none before those columns)."""
    lines: list[str] = []
    own = r.get("own_window")
    if own:
        w = own["window"]
        lines += [
            "",
            f"Own-window control: the same model and windows, every query limited to its last {w} "
            "keys (the training length); negative full - own window: the keys beyond it help.",
            "",
            "| length | x train | full context | own window | full - own window |",
            "|---|---|---|---|---|",
        ]
        for t, v in own["loss"].items():
            full = r["loss"][t]
            lines.append(
                f"| {t} | {int(t) // r['train_len']} | {full:.4f} | {v:.4f} | {full - v:+.4f} |"
            )
    if r.get("copy"):
        c, oc = r["copy"], (own or {}).get("copy")
        lines += [
            "",
            f"Copy probe: {c['probes']} segments of {c['segment']} tokens, each repeated after "
            "other held-out text; loss on the second copy (the first copy's loss beside it). "
            "A model that reads back d tokens scores the second copy far below the first.",
            "",
            "| distance | x train | first copy | second copy"
            + (" | second copy, own window | full - own window |" if oc else " |"),
            "|---|---|---|---" + ("|---|---|" if oc else "|"),
        ]
        for d, second in c["second"].items():
            row = f"| {d} | {int(d) // r['train_len']} | {c['first'][d]:.4f} | {second:.4f} |"
            if oc:
                row += f" {oc['second'][d]:.4f} | {second - oc['second'][d]:+.4f} |"
            lines.append(row)
    return lines


def results_markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# Evaluation of {r['run']}",
        "",
        f"Trained with **{r['trained_attention']}**, evaluated as **{label_of(r)}** at step "
        f"{r['step']}; {r['tokens_per_length']} validation tokens per length, in windows spread "
        "over the whole split.",
        "",
        "| length | x train | windows | val loss |",
        "|---|---|---|---|",
    ]
    for t, loss in r["loss"].items():
        n = r["windows_per_length"][t]
        lines.append(f"| {t} | {int(t) // r['train_len']} | {n} | {loss:.4f} |")
    lines += _context_markdown(r)
    if "diagnostics" in r:
        lines += [
            "",
            "| length | windows | mean entropy (nats) | uniform ln N | first-token mass | "
            "uniform 1/N |",
            "|---|---|---|---|---|---|",
        ]
        for t, d in r["diagnostics"].items():
            lines.append(
                f"| {t} | {d['windows']} | {np.mean(d['entropy']):.3f} | "
                f"{d['uniform_entropy']:.3f} | {np.mean(d['sink']):.4f} | {d['uniform_sink']:.4f} |"
            )
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
        pk = r["passkey"]
        depths = list(next(iter(pk["accuracy"].values())))
        lines += [
            "",
            f"Passkey: fine-tuned {pk['steps']} steps at the training length; accuracy on "
            f"training-text probes {pk['check_accuracy']:.0%} "
            f"({'reached' if pk['reached'] else 'did not reach'} the target).",
        ]
        if "by_distance" in pk:
            lines += ["", "| length | key within L: hits / probes | beyond L |", "|---|---|---|"]
            for t, b in pk["by_distance"].items():
                lines.append(
                    f"| {t} | {b['within']['hits']} / {b['within']['n']} | "
                    f"{b['beyond']['hits']} / {b['beyond']['n']} |"
                )
        lines += [
            "",
            "| length | " + " | ".join(f"depth {d}" for d in depths) + " |",
            "|---" * (len(depths) + 1) + "|",
        ]
        for t, row in pk["accuracy"].items():
            lines.append(f"| {t} | " + " | ".join(f"{row[d]:.0%}" for d in depths) + " |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """``lssar eval``'s options, each described (``lssar eval --help``)."""
    ap = clihelp.parser("lssar eval", __doc__)
    ap.add_argument("run", help="run directory (from lssar train)")
    ap.add_argument(
        "--lengths",
        default="1,2,4,8,16",
        help="evaluation lengths as multiples of the training length, comma-separated",
    )
    ap.add_argument(
        "--attn",
        metavar=clihelp.one_of(VARIANTS),
        help="evaluate with this attention variant instead of the trained one (its defaults; "
        "the trained impl is kept where it runs it); none: the trained one",
    )
    ap.add_argument(
        "--attn-p",
        type=float,
        help="re-weighting power p for the evaluation (lssar, softmax-qknorm-logn), on top of "
        "the trained options; none: as trained",
    )
    ap.add_argument(
        "--window",
        type=int,
        help="sliding window: every query sees only its last WINDOW keys (the training length "
        "is the control for flat loss); none: every earlier key",
    )
    ap.add_argument(
        "--rope-scaling",
        metavar=clihelp.one_of(ROPE_SCALINGS),
        help="rescale a RoPE model's rotation at evaluation (PI, NTK-aware, dynamic NTK, YaRN); "
        "none: as trained",
    )
    ap.add_argument(
        "--rope-factor",
        help="the scaling's factor s: a number, or auto = evaluated length / training length "
        "(none: auto)",
    )
    ap.add_argument(
        "--tokens", type=int, default=65536, help="validation tokens scored at every length"
    )
    ap.add_argument(
        "--passkey", action="store_true", help="also fine-tune on passkey retrieval and test it"
    )
    dflt = PasskeySettings()
    ap.add_argument(
        "--passkey-steps",
        type=int,
        default=dflt.steps,
        help="passkey fine-tuning steps, the same for every run (no early stop)",
    )
    ap.add_argument(
        "--passkey-target",
        type=float,
        default=dflt.target,
        help="passkey accuracy at the training length below which the task counts as not "
        "learned (inconclusive)",
    )
    ap.add_argument(
        "--passkey-digits", type=int, default=dflt.digits, help="digits of each passkey"
    )
    ap.add_argument(
        "--no-diagnostics",
        action="store_true",
        help="skip the attention diagnostics (entropy, first-token mass) and numerical health",
    )
    ap.add_argument(
        "--no-context",
        action="store_true",
        help="skip the own-window control and the copy probe (whether keys beyond L are used)",
    )
    ap.add_argument(
        "--copy-probes", type=int, default=COPY_PROBES, help="copy-probe sequences per distance"
    )
    ap.add_argument(
        "--tag",
        help="name of the output folder under RUN/eval/; none: from the rule and the window",
    )
    return ap


def cli(argv: list[str]) -> int:
    if argv and not argv[0].startswith("-"):
        from lssar.studies.lm.evaluate_hf import cli as hf_cli
        from lssar.studies.lm.evaluate_hf import is_model_dir

        if is_model_dir(argv[0]):  # a Hugging Face model directory, not an lssar train run
            return hf_cli(argv)
    ap = parser()
    dflt = PasskeySettings()
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist; train one with lssar train")
    pk = dataclasses.replace(
        dflt,
        steps=args.passkey_steps,
        warmup_steps=min(dflt.warmup_steps, args.passkey_steps),
        target=args.passkey_target,
        digits=args.passkey_digits,
    )
    r = evaluate_run(
        run,
        parse_multiples(args.lengths),
        args.attn,
        args.attn_p,
        args.tokens,
        diagnostics=not args.no_diagnostics,
        health=not args.no_diagnostics,
        passkey=pk if args.passkey else None,
        window=args.window,
        tag=args.tag,
        rope_scaling=args.rope_scaling,
        rope_factor=args.rope_factor,
        context=not args.no_context,
        copy_probes=args.copy_probes,
    )
    print(results_markdown(r))
    print(f"saved to {Path(r['run']) / 'eval' / r['tag']}")
    return 0
