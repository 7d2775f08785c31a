"""The conversion study's report: what converting a pretrained model costs and what it buys
beyond the conversion length, judged by the project's statistics (means and 95% t-intervals over
seeds, differences paired by seed, Holm over the declared claims, TOST for "matches").

Written from the study's results (:func:`lssar.studies.convert.study.run_unit`), never by hand:
``REPORT.md``, ``results.json`` (LM-report form, so ``lssar.studies.findings`` markers can quote
it) and PNG figures.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lssar.runio import environment
from lssar.studies.common import conditions, provenance_head, write_report
from lssar.studies.convert.presets import LSSA, LSSAR15, ORIGINAL, PRESETS, SOFTMAX, Preset
from lssar.studies.labels import group, label_of
from lssar.studies.stats import Claim, Interval, judge_claims, mean_ci

SM, LR, LA = SOFTMAX.label, LSSAR15.label, LSSA.label
MATCH_MARGIN = 0.02  # "matches at L": |loss ratio - 1| < 2%, as the LM study's equivalence claim


def _w(label: str, p: Preset) -> str:
    """The label of ``label``'s own-window rows (:func:`lssar.studies.labels.label_of`)."""
    sinks = f" + {p.sink_tokens} sinks" if p.sink_tokens else ""
    return f"{label}, sliding window {p.seq_len}{sinks}"


def _yarn(label: str) -> str:
    return f"{label} -> yarn auto (eval only)"


def per_seed(rows: list[dict[str, Any]], length: int, key: str = "loss") -> dict[int, float]:
    """seed -> ``key`` (``loss``, ``loss_band``) at ``length`` over an arm's results."""
    out = {}
    for r in rows:
        v = r.get(key, {}).get(str(length))
        if v is not None:
            out[r["config"]["seed"]] = v
    return out


def copy_seeds(rows: list[dict[str, Any]], d: int) -> dict[int, float]:
    return {
        r["config"]["seed"]: r["copy"]["second"][str(d)]
        for r in rows
        if r.get("copy") and str(d) in r["copy"]["second"]
    }


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def declared_claims(g: dict[str, list[dict[str, Any]]], p: Preset) -> list[Claim]:
    """The study's declared claims (one family for Holm); a claim whose arms are absent is left
    out."""
    L = p.seq_len
    far, d = max(p.multiples) * L, max(p.copy_multiples) * L
    x, longest = far // L, max(p.long_multiples, default=0) * L

    def at(label: str, t: int) -> dict[int, float]:
        return per_seed(g.get(label, []), t)

    def copied(label: str) -> dict[int, float]:
        return copy_seeds(g.get(label, []), d)

    a, b = _aligned(at(LR, L), at(SM, L))
    rows = [
        (f"LSSAR matches the fine-tuned softmax at the conversion length (L = {L})",
         [u / v - 1 for u, v in zip(a, b)],
         f"|LSSAR / softmax - 1| < {MATCH_MARGIN:.0%} at L (TOST)", {"margin": MATCH_MARGIN}),
        (f"LSSAR beats the fine-tuned softmax at {x}x L",
         _paired(at(LR, far), at(SM, far)), "LSSAR - softmax < 0", {"hi": 0.0}),
        (f"LSSAR at {x}x L does better than the sliding-window control",
         _paired(at(LR, far), at(_w(SM, p), far)), "LSSAR - softmax window < 0", {"hi": 0.0}),
        (f"LSSAR uses context beyond L (full context beats its own L-key window at {x}x)",
         _paired(at(LR, far), at(_w(LR, p), far)), "LSSAR full - own window < 0", {"hi": 0.0}),
        (f"Fine-tuned softmax uses context beyond L (full context beats its own window at {x}x)",
         _paired(at(SM, far), at(_w(SM, p), far)), "softmax full - own window < 0", {"hi": 0.0}),
        (f"LSSAR copies from {d // L}x L back (copy probe: full context beats its own window)",
         _paired(copied(LR), copied(_w(LR, p))), "second copy, full - own window < 0",
         {"hi": 0.0}),
        (f"LSSAR beats LSSA at {x}x L (re-weighting helps)",
         _paired(at(LR, far), at(LA, far)), "LSSAR - LSSA < 0", {"hi": 0.0}),
    ]  # fmt: skip
    if longest:
        y = longest // L
        rows += [
            (f"LSSAR beats the fine-tuned softmax at {y}x L (past the model's own positions)",
             _paired(at(LR, longest), at(SM, longest)), "LSSAR - softmax < 0", {"hi": 0.0}),
            (f"LSSAR beats softmax with YaRN at {y}x L",
             _paired(at(LR, longest), at(_yarn(SM), longest)), "LSSAR - softmax+YaRN < 0",
             {"hi": 0.0}),
        ]  # fmt: skip
    return [Claim(text, v, crit, **bound) for text, v, crit, bound in rows if v]


def _aligned(a: dict[int, float], b: dict[int, float]) -> tuple[list[float], list[float]]:
    seeds = sorted(set(a) & set(b))
    return [a[s] for s in seeds], [b[s] for s in seeds]


def _fmt(iv: Interval, digits: int = 3) -> str:
    if iv.lo is None:
        return f"{iv.mean:.{digits}f}"
    return f"{iv.mean:.{digits}f} ± {iv.half:.{digits}f}"


def _sfmt(iv: Interval, digits: int = 3) -> str:
    s = _fmt(iv, digits)
    return ("+" if iv.mean >= 0 else "−") + s.lstrip("-").replace("-", "−")


def _order(labels: list[str], p: Preset) -> list[str]:
    first = [ORIGINAL, SM, _yarn(SM), _w(SM, p), LR, _w(LR, p)]
    return [x for x in first if x in labels] + [x for x in labels if x not in first]


def loss_table(g: dict[str, list[dict]], lengths: list[int], p: Preset, key: str) -> list[str]:
    L = p.seq_len
    head = "| arm | " + " | ".join(f"{t // L}x ({t})" for t in lengths) + " |"
    out = [head, "|---" * (len(lengths) + 1) + "|"]
    for lab in _order(list(g), p):
        cells = []
        for t in lengths:
            v = per_seed(g[lab], t, key)
            cells.append(_fmt(mean_ci(list(v.values()))) if v else "")
        if any(cells):
            out.append(f"| {lab} | " + " | ".join(cells) + " |")
    return out


def diff_table(g: dict[str, list[dict]], pairs: list[tuple[str, str]], lengths, L) -> list[str]:
    out = ["| difference | " + " | ".join(f"{t // L}x" for t in lengths) + " |"]
    out.append("|---" * (len(lengths) + 1) + "|")
    for a, b in pairs:
        if a not in g or b not in g:
            continue
        cells = []
        for t in lengths:
            d = _paired(per_seed(g[a], t), per_seed(g[b], t))
            cells.append(_sfmt(mean_ci(d)) if d else "")
        out.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    return out


def write(p: Preset, results: list[dict[str, Any]], out: Path) -> Path:
    """Write the report of ``results`` to ``out``."""
    g = group(results)
    L = p.seq_len
    lengths = [m * L for m in p.multiples]
    longs = [m * L for m in p.long_multiples]
    claims = declared_claims(g, p)
    judged = judge_claims(claims)
    envs = [r["env"] for r in results if r.get("env")] + [r["eval_env"] for r in results]
    env = environment("cpu")
    src = next((r["env"].get("source", {}) for r in results if r.get("env", {}).get("source")), {})
    lines = [
        f"# Converting a pretrained model: {p.name}",
        "",
        provenance_head(envs, env) + " " + conditions(envs),
        "",
        *_part(p),
        f"{p.summary}. Model: {src.get('original') or src.get('note', p.model)}. Conversion "
        f"length L = {L}; every "
        f"trained arm fine-tuned from the same weights for {p.steps} steps of {p.batch_size} x "
        f"{p.grad_accum} packed windows of L tokens ({p.steps * p.batch_size * p.grad_accum * L:,}"
        f" tokens), warmup {p.warmup} + cosine, peak lr {p.lr:g}, trainable: {p.trainable}; "
        f"seeds {', '.join(map(str, p.seeds))} (the data order). Intervals: 95% t over seeds, "
        "differences paired by seed.",
        "",
        "## Recovery: held-out loss at L during fine-tuning",
        "",
        *recovery_table(g, L),
        "",
        "## Loss by evaluation length",
        "",
        f"Cumulative mean next-token loss over the first T tokens of {p.documents} held-out "
        "documents per cell (one forward per document; the model is causal, so this equals "
        "evaluating each document's first T tokens): "
        + ", ".join(f"{t}: {t * p.documents:,} tokens" for t in lengths)
        + " per seed. Rows with a sliding window see only their last L keys"
        + (
            f" and the document's first {p.sink_tokens} tokens (attention sinks: a pretrained "
            "model's queries lean on them; fine-tuning windows always held them)."
            if p.sink_tokens
            else "."
        ),
        "",
        *loss_table(g, lengths, p, "loss"),
        *(
            [
                "",
                "YaRN's factor is the evaluated length over the model's pretrained positions, "
                "and 1 (no scaling) up to them: at these lengths its rows repeat softmax's; it "
                "acts past them (below).",
            ]
            if _yarn(SM) in g
            else []
        ),
        "",
        "Loss of the positions in (T/2, T] only (what the tokens at each length add):",
        "",
        *loss_table(g, lengths, p, "loss_band"),
    ]
    if longs:
        lines += [
            "",
            f"## Past the model's own positions ({', '.join(map(str, longs))} tokens)",
            "",
            f"{p.long_documents} document(s) per seed, {max(longs) * p.long_documents:,} tokens "
            "scored per cell at the longest length.",
            "",
            *loss_table(g, longs, p, "loss"),
        ]
    lines += [
        "",
        "## Does the model use context beyond L?",
        "",
        "Full context minus the same model's own L-key window, paired by seed (negative: the "
        "keys beyond L help):",
        "",
        *diff_table(
            g, [(lab, _w(lab, p)) for lab in _order(list(g), p) if _w(lab, p) in g], lengths, L
        ),  # fmt: skip
        "",
        *copy_table(g, p),
        "",
        "## The declared claims",
        "",
        "| claim | criterion | value | verdict (Holm) | note |",
        "|---|---|---|---|---|",
    ]
    for c, (_raw, final, note) in zip(claims, judged):
        value = _sfmt(mean_ci(c.values))
        lines.append(f"| {c.text} | {c.criterion} | {value} | {final} | {note} |")
    lines += ["", *timing(results)]
    data = {
        "preset": dataclasses.asdict(p),
        "results": results,
        "claims": [
            {
                "text": c.text,
                "criterion": c.criterion,
                "values": c.values,
                "raw": raw,
                "verdict": final,
                "note": note,
            }
            for c, (raw, final, note) in zip(claims, judged)
        ],  # fmt: skip
        "env": env,
    }
    write_report(out, lines, data)
    plot(g, p, out)
    return out


def _part(p: Preset) -> list[str]:
    """A paragraph saying which of its preset's arms and seeds a partial report holds."""
    full = PRESETS.get(p.name)
    if full is None or (set(p.arms) >= set(full.arms) and set(p.seeds) >= set(full.seeds)):
        return []
    arms = ", ".join(a for a in full.arms if a in p.arms)
    return [
        f"**Part of the study**: arms {arms} of {', '.join(full.arms)}; seeds "
        f"{', '.join(map(str, p.seeds))} of {', '.join(map(str, full.seeds))}. The rest runs "
        "into the same directory later (its finished units are carried in `units/`).",
        "",
    ]


def _plain(r: dict[str, Any]) -> bool:
    """A full-context result at the preset's lengths (one per arm and seed)."""
    return not (r.get("window") or r.get("rope_scaling") or r.get("long"))


def _curves(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [r["curve"] for r in rows if r.get("curve") and _plain(r)]


def recovery_table(g: dict[str, list[dict]], L: int) -> list[str]:
    steps = sorted({c["step"] for rows in g.values() for cur in _curves(rows) for c in cur})
    if not steps:
        return []
    out = ["| arm | " + " | ".join(f"step {s}" for s in steps) + " |"]
    out.append("|---" * (len(steps) + 1) + "|")
    for lab, rows in g.items():
        curves = _curves(rows)
        if not curves:
            continue
        cells = []
        for s in steps:
            v = [c["val_loss"] for cur in curves for c in cur if c["step"] == s]
            cells.append(_fmt(mean_ci(v)) if v else "")
        out.append(f"| {lab} | " + " | ".join(cells) + " |")
    orig = per_seed(g.get(ORIGINAL, []), L)
    if orig:
        out += [
            "",
            f"The original model (not fine-tuned) on the same documents at L: "
            f"{_fmt(mean_ci(list(orig.values())))} (cumulative loss over the first L tokens).",
        ]
    return out


def copy_table(g: dict[str, list[dict]], p: Preset) -> list[str]:
    L = p.seq_len
    ds = [m * L for m in p.copy_multiples]
    out = [
        f"Copy probe ({p.copy_probes} probes per distance per seed; a {64}-token segment of "
        "held-out text repeated d tokens later): loss on the second copy (the first copy's "
        "loss in the last column). A model that reads back d tokens scores the second copy "
        "far below the first.",
        "",
        "| arm | " + " | ".join(f"d = {d // L}x L" for d in ds) + " | first copy |",
        "|---" * (len(ds) + 2) + "|",
    ]
    for lab in _order(list(g), p):
        rows = [r for r in g[lab] if r.get("copy")]
        if not rows:
            continue
        cells = []
        for d in ds:
            v = copy_seeds(rows, d)
            cells.append(_fmt(mean_ci(list(v.values()))) if v else "")
        first = [r["copy"]["first"][str(ds[-1])] for r in rows]
        out.append(f"| {lab} | " + " | ".join(cells) + f" | {_fmt(mean_ci(first))} |")
    return out


def timing(results: list[dict[str, Any]]) -> list[str]:
    secs: dict[str, list[float]] = {}
    for r in results:
        if not _plain(r) or r["arm"] == ORIGINAL:
            continue
        if (s := r.get("train_seconds")) is not None:
            secs.setdefault(label_of(r), []).append(s)
    if not secs:
        return []
    parts = [f"{lab} {sum(v) / len(v) / 60:.0f} min" for lab, v in secs.items()]
    return [f"Fine-tuning time per run (mean over seeds, this machine): {', '.join(parts)}."]


def plot(g: dict[str, list[dict]], p: Preset, out: Path) -> None:
    """``recovery.png`` (held-out loss at L vs step) and ``loss_by_position.png`` (loss along
    the longest window, each arm and its own window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lssar.studies.style import style

    fig, ax = plt.subplots(figsize=(6, 4))
    for lab, rows in g.items():
        curves = _curves(rows)
        if not curves:
            continue
        steps = [c["step"] for c in curves[0]]
        mean = [sum(cur[i]["val_loss"] for cur in curves) / len(curves) for i in range(len(steps))]
        ax.plot(steps, mean, label=lab, **style(lab))
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel(f"held-out loss at L = {p.seq_len}")
    if ax.lines:  # a part of the study without a fine-tuned arm has no curve
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "recovery.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for lab in _order(list(g), p):
        rows = [r for r in g[lab] if r.get("loss_by_position") and not r.get("long")]
        if not rows:
            continue
        edges = rows[0]["position_buckets"]
        xs = [(a + b) / 2 for a, b in edges]
        ys = [sum(r["loss_by_position"][i] for r in rows) / len(rows) for i in range(len(xs))]
        ax.plot(xs, ys, label=lab, **style(lab))
    ax.axvline(p.seq_len, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("position in the document (tokens)")
    ax.set_ylabel("next-token loss")
    if ax.lines:  # a part of the study without a fine-tuned arm has no curve
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_by_position.png", dpi=120)
    plt.close(fig)
