"""REPORT.md, results.json and plots of ``lssar reproduce``, generated from the evaluation results.

The paper's numbers live here, beside the claims that are judged about them (the arms are
declared in :mod:`.presets`): every verdict comes from a 95% interval over seeds
(:mod:`lssar.studies.stats`), differences paired by seed.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np

from lssar.runio import environment
from lssar.studies.common import provenance_head
from lssar.studies.common import write_report as write_files
from lssar.studies.lm.figures import group, normalised, plot_results
from lssar.studies.lm.presets import (
    ALTERNATIVES,
    LSSA,
    LSSA_CONST,
    LSSAR3,
    LSSAR15,
    QK_CONST,
    QK_LEARNED,
    QKNORM,
    QKNORM15,
    RELU,
    SIGMOID,
    SOFTMAX,
    SOFTPLUS_L1,
    Preset,
)
from lssar.studies.stats import (
    Claim,
    Interval,
    judge,
    judge_claims,
    mean_ci,
    paired_ci,
    tost,
    verdict,
)

# The paper's validation loss (GPT-2 124M, FineWeb, trained at 1024; METHOD.md section 7),
# keyed by evaluation length / training length.
PAPER = {
    arm.label: loss
    for arm, loss in (
        (SOFTMAX, {1: 3.19, 2: 4.17, 4: 5.45, 8: 6.28, 16: 7.02}),
        (SIGMOID, {1: 3.19, 2: 7.46, 4: 11.84, 8: 14.50}),
        (RELU, {1: 3.21, 2: 6.27, 4: 8.50, 8: 10.35}),
        (LSSA, {1: 3.19, 2: 4.13, 4: 5.30, 8: 5.94}),
        (LSSAR3, {1: 3.18, 2: 4.24, 4: 5.41, 8: 6.30}),
        (LSSAR15, {1: 3.19, 2: 3.19, 4: 3.23, 8: 3.32, 16: 3.32}),
    )
}

Seeds = dict[int, float]  # seed -> value
# Margins of the equivalence tests (TOST), the only way this report says "matches" or "as well"
LOSS_MARGIN = 0.02  # nats of validation loss
RELATIVE_MARGIN = 0.02  # of a ratio: ±2%
WINDOW = "softmax, sliding window"  # label prefix of the window control (label_of adds the size)


def _find(groups: dict[str, Any], prefix: str) -> str | None:
    return next((k for k in groups if k.startswith(prefix)), None)


def _losses(groups, multiples) -> dict[str, dict[int, Seeds]]:
    """label -> multiple -> seed -> validation loss."""
    return {
        label: {
            m: {r["config"]["seed"]: r["loss"][str(m * r["train_len"])] for r in rs}
            for m in multiples
        }
        for label, rs in groups.items()
    }


def _iv(values: Seeds) -> Interval:
    return mean_ci([values[k] for k in sorted(values)])


def _pairs(a: Seeds, b: Seeds, relative: bool = False) -> list[float]:
    """Per-seed ``a - b`` (or ``a / b - 1``), over the seeds both have, in seed order."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("no common seed to pair")
    return [a[s] / b[s] - 1 if relative else a[s] - b[s] for s in seeds]


def _diff(a: Seeds, b: Seeds, relative: bool = False) -> Interval:
    """a - b (or a / b - 1) paired by seed, over the seeds both have."""
    if relative:
        return mean_ci(_pairs(a, b, relative=True))
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("no common seed to pair")
    return paired_ci([a[s] for s in seeds], [b[s] for s in seeds])


def _ratios(v: dict[int, Seeds], top: int) -> list[float]:
    return [v[top][s] / v[1][s] for s in sorted(v[1])]


def _ratio(v: dict[int, Seeds], top: int) -> Interval:
    return mean_ci(_ratios(v, top))


def _fmt(iv: Interval, digits: int = 3, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f.format(iv.mean) if iv.lo is None else f"{f.format(iv.mean)} ± {iv.half:.{digits}f}"


def _word(v: str) -> str:
    """Verdict of "a - b < 0" as a table word."""
    return {"supported": "lower", "contradicted": "higher"}.get(v, v)


def _loss_table(losses, multiples, groups) -> list[str]:
    top = max(multiples)
    rows = [
        "| attention | seeds x scored tokens | "
        + " | ".join(f"{m}x" for m in multiples)
        + f" | {top}x / 1x |",
        "|---" * (len(multiples) + 3) + "|",
    ]
    first = next(iter(groups.values()))[0]
    for label, v in losses.items():
        cells = [_fmt(_iv(v[m])) for m in multiples]
        n = f"{len(v[1])} x {first['tokens_per_length']}"
        rows.append(f"| {label} | {n} | " + " | ".join(cells) + f" | {_fmt(_ratio(v, top), 2)} |")
    per_length = first["windows_per_length"]
    windows = " / ".join(str(per_length[str(m * first["train_len"])]) for m in multiples)
    return rows + [
        "",
        f"Each cell: mean ± the half-width of the 95% t-interval over the seeds (no interval "
        f"with one seed). Scored tokens per length and seed: {first['tokens_per_length']}, in "
        f"{windows} windows at {' / '.join(f'{m}x' for m in multiples)}, spread evenly over "
        "the whole validation split.",
    ]


def declared_claims(losses, multiples) -> list[Claim]:
    """The paper's claims present in ``losses`` (the declared family Holm corrects over), each
    on its per-seed values: a ratio, or a difference paired by seed."""
    top = max(multiples)
    soft, lssa = losses.get(SOFTMAX.label), losses.get(LSSA.label)
    lssar, qk = losses.get(LSSAR15.label), losses.get(QKNORM.label)
    window = losses.get(_find(losses, WINDOW) or "")
    below = dict(criterion="criterion < 0", hi=0.0)
    out: list[Claim] = []
    if lssar:
        text = f"LSSAR (p=15) loss stays nearly flat to {top}x (paper x1.04): {top}x / 1x"
        out.append(Claim(text, _ratios(lssar, top), "criterion <= 1.10", 2, hi=1.10))
    if soft:
        text = (
            f"Softmax+RoPE degrades sharply beyond the training length (paper x2.20): {top}x / 1x"
        )
        out.append(Claim(text, _ratios(soft, top), "criterion >= 1.5", 2, lo=1.5))
    if soft and lssar:
        text = f"LSSAR beats softmax at {top}x: lssar p=15 - softmax"
        out.append(Claim(text, _pairs(lssar[top], soft[top]), **below))
        text = (
            "LSSAR matches softmax at the training length (paper 3.19 vs 3.19): lssar / softmax - 1"
        )
        crit = f"equivalence within ±{RELATIVE_MARGIN:.0%}, TOST"
        rel = _pairs(lssar[1], soft[1], relative=True)
        out.append(Claim(text, rel, crit, margin=RELATIVE_MARGIN))
    if soft and lssa:
        text = (
            "LSSA alone beats softmax beyond the training length (paper 5.94 vs 6.28 at 8x): "
            f"lssa - softmax at {top}x"
        )
        out.append(Claim(text, _pairs(lssa[top], soft[top]), **below))
    if lssa and lssar:
        text = (
            f"Re-weighting (stage 2) is what makes lengths extrapolate: lssar p=15 - lssa at {top}x"
        )
        out.append(Claim(text, _pairs(lssar[top], lssa[top]), **below))
    for label, v in losses.items():
        if label.startswith("lssa -> ") and lssa:
            text = f"Fine-tuning-free re-weighting improves long contexts: {label} - lssa at {top}x"
            out.append(Claim(text, _pairs(v[top], lssa[top]), **below))
    if lssar and qk:
        text = (
            f"LSSAR beats the strongest baseline (softmax with LSSA's QK-norm and length scale) "
            f"at {top}x: lssar p=15 - softmax-qknorm-logn"
        )
        out.append(Claim(text, _pairs(lssar[top], qk[top]), **below))
    if lssar and window:
        text = (
            f"LSSAR at {top}x does better than a model that sees only the last L tokens: "
            "lssar p=15 - sliding-window softmax"
        )
        out.append(Claim(text, _pairs(lssar[top], window[top]), **below))
    return out


def _claims(losses, multiples) -> list[str]:
    """The paper's claims, each judged from its 95% interval over seeds (differences paired by
    seed), then corrected for multiplicity over the declared list (Holm); the window control's
    consequence said only as far as an equivalence test allows."""
    claims = declared_claims(losses, multiples)
    judged = judge_claims(claims)
    out = []
    final_of: dict[str, str] = {}
    for c, (_raw, final, note) in zip(claims, judged):
        iv = mean_ci(c.values)
        out.append(
            f"- **{c.text}**: measured {_fmt(iv, c.digits)} -> **{final}** ({c.criterion}; {note})."
        )
        final_of[c.text] = final
    window_claim = next((c for c in claims if "sliding-window" in c.text), None)
    if window_claim is not None and final_of[window_claim.text] != "supported":
        out.append("  " + _window_sentence(window_claim.values, final_of[window_claim.text]))
    return out


def _window_sentence(diffs: list[float], verdict: str) -> str:
    """What the window control says about "flat loss", from LSSAR - window per seed: *better*
    only from a (Holm-corrected) contradicted claim, *as well* only from TOST against
    ±:data:`LOSS_MARGIN`, else not separable, with the interval."""
    head = (
        "So flat loss here does **not** show that LSSAR uses context beyond the training "
        "length: attending to the last L tokens only"
    )
    if verdict == "contradicted":
        return f"{head} does better."
    eq = tost(diffs, margin=LOSS_MARGIN)
    if eq.equivalent:
        return (
            f"{head} does as well: equivalent within ±{LOSS_MARGIN} loss (TOST, 90% interval "
            f"{eq.lo:+.3f} .. {eq.hi:+.3f})."
        )
    iv = mean_ci(diffs)
    where = "no interval with one seed" if iv.lo is None else f"95% interval {_fmt(iv, 3, True)}"
    return (
        "Whether LSSAR uses context beyond the training length is **not separable at this "
        f"power** from the window control: lssar p=15 - window = {where}, neither better nor "
        f"equivalent within ±{LOSS_MARGIN} loss (TOST)."
    )


# (question, a, b): the rows of the decomposition, "a - b" at every length; each row changes one
# thing unless its question says otherwise. The constant-scale arms' labels carry their n
# ("softmax-qknorm-const n=128"), found by :func:`_lookup`.
DECOMPOSITION = [
    ("+ QK-norm and ln N scale (two changes)", QKNORM.label, SOFTMAX.label),
    (
        "+ QK-norm, scale fixed at ln d ln L (two changes: norm and scale)",
        QK_CONST.label,
        SOFTMAX.label,
    ),
    ("+ ln N scale given QK-norm (ln N_i instead of the fixed ln L)", QKNORM.label, QK_CONST.label),
    (
        "learned per-head scale instead of the fixed one, given QK-norm",
        QK_LEARNED.label,
        QK_CONST.label,
    ),
    ("+ ln N scale vs a learned per-head scale, given QK-norm", QKNORM.label, QK_LEARNED.label),
    (
        "Softplus-l1 instead of softmax, no QK-norm, no length scale",
        SOFTPLUS_L1.label,
        SOFTMAX.label,
    ),
    (
        "Softplus-l1 instead of softmax, given QK-norm and the fixed scale",
        LSSA_CONST.label,
        QK_CONST.label,
    ),
    ("Softplus-l1 instead of softmax, given QK-norm and ln N", LSSA.label, QKNORM.label),
    ("+ ln N scale given QK-norm and Softplus-l1", LSSA.label, LSSA_CONST.label),
    ("+ re-weighting p=15 on LSSA (trained)", LSSAR15.label, LSSA.label),
    ("+ re-weighting p=3 on LSSA (trained)", LSSAR3.label, LSSA.label),
    ("+ re-weighting p=15 on softmax-qknorm-logn (trained)", QKNORM15.label, QKNORM.label),
    ("Softplus-l1 instead of softmax, given QK-norm, ln N and p=15", LSSAR15.label, QKNORM15.label),
    (
        "LSSAR vs the strongest baseline (two changes: Softplus-l1, p=15)",
        LSSAR15.label,
        QKNORM.label,
    ),
    ("LSSAR vs the sliding-window control", LSSAR15.label, WINDOW),
]


def _lookup(losses: dict[str, Any], key: str) -> str | None:
    """The result label of ``key``: itself, the window control's (``WINDOW``: its size added),
    or a constant-scale arm's with its ``n`` (``"lssa-const"`` -> ``"lssa-const n=128"``)."""
    if key in losses:
        return key
    if key == WINDOW:
        return _find(losses, WINDOW)
    return _find(losses, f"{key} n=")


def _diff_table(losses, multiples, rows: list[tuple[str, str, str]], head="question") -> list[str]:
    out = [
        f"| {head} | a - b | " + " | ".join(f"{m}x" for m in multiples) + " |",
        "|---" * (len(multiples) + 2) + "|",
    ]
    for question, a, b in rows:
        a, b = _lookup(losses, a), _lookup(losses, b)
        if a is None or b is None:
            continue
        cells = []
        for m in multiples:
            iv = _diff(losses[a][m], losses[b][m])
            cells.append(f"{_fmt(iv, 3, sign=True)} {_word(judge(iv, hi=0.0))}")
        out.append(f"| {question} | {a} - {b} | " + " | ".join(cells) + " |")
    return out + [
        "",
        "Each cell: the loss difference a - b paired by seed, mean ± the 95% t-interval's "
        "half-width; **lower** / **higher** when the interval excludes 0 (a is better / worse), "
        "else *within noise*. Exploratory: not corrected for the many cells, and *within noise* "
        "is not a tie (only the declared claims' equivalence tests say *matches*).",
    ]


def _every_arm(losses, multiples, against: str) -> list[str]:
    rows = [(label, label, against) for label in losses if label != against]
    return _diff_table(losses, multiples, rows, head="arm")


# what each of the practitioner's alternatives is, by result label (presets.ALTERNATIVES)
ALTERNATIVE_NAMES = dict(
    zip(
        ALTERNATIVES,
        [
            "ALiBi (softmax, trained)",
            "NoPE (softmax, trained)",
            "LSSAR p=15 without positions (NoPE, trained)",
            "position interpolation (PI) on softmax+RoPE",
            "NTK-aware scaling on softmax+RoPE",
            "dynamic NTK on softmax+RoPE",
            "YaRN on softmax+RoPE",
        ],
    )
)


def _alternatives(losses, multiples) -> list[str]:
    """LSSAR p=15 against every alternative present (paired differences and verdicts at every
    length), and which method has the lowest loss at the longest length, said only as far as
    the paired intervals allow."""
    present = [a for a in ALTERNATIVES if a in losses]
    if not present or LSSAR15.label not in losses:
        return []
    top = max(multiples)
    rows = [(ALTERNATIVE_NAMES[a], LSSAR15.label, a) for a in present]
    lines = [
        "## LSSAR against the practitioner's alternatives",
        "",
        "What a user would pick instead of LSSAR to run beyond the training length: ALiBi or no "
        "position encoding, trained in (same model, data, steps and seeds, only the positions "
        "differ), and RoPE rescaled at evaluation only on the softmax runs, each at factor = "
        "evaluation length / training length at every length (so at 1x each is the softmax "
        "model itself). A negative difference means LSSAR p=15 has the lower loss.",
        "",
        *_diff_table(losses, multiples, rows, head="alternative"),
        "",
    ]
    candidates = [m for m in (LSSAR15.label, SOFTMAX.label, *present) if m in losses]
    ranked = sorted(candidates, key=lambda m: _iv(losses[m][top]).mean)
    best, best_iv = ranked[0], _iv(losses[ranked[0]][top])
    head = f"Lowest mean loss at {top}x among {', '.join(candidates)}: **{best}**, {_fmt(best_iv)}"
    if best_iv.lo is None:
        return lines + [
            f"{head}. With one seed there is no interval, so no method is best beyond noise.",
            "",
        ]
    gaps = {m: _diff(losses[m][top], losses[best][top]) for m in ranked[1:]}  # m - best
    close = [m for m, iv in gaps.items() if judge(iv, lo=0.0) != "supported"]
    runner = ranked[1]
    gap = f"{runner} - {best} = {_fmt(gaps[runner], 3, sign=True)}"
    if not close:
        verdict_line = (
            f"{head}: **the best method at {top}x**, beyond noise: its paired interval against "
            f"every other method excludes 0 (runner-up: {gap})."
        )
    else:
        verdict_line = (
            f"{head}, but it is **not separable** from {', '.join(close)} at this power: "
            "the paired interval of their difference includes 0 "
            f"({'; '.join(f'{m} - {best} = {_fmt(gaps[m], 3, sign=True)}' for m in close)})."
        )
    return lines + [verdict_line, ""]


def _diagnostics(groups, multiples) -> list[str]:
    top = max(multiples)
    lines = [
        "| attention | windows | entropy 1x [uniform] | entropy, rows beyond L at "
        f"{top}x [uniform] | first-token mass 1x [uniform] | first-token mass, rows beyond L "
        f"at {top}x [uniform] |",
        "|---|---|---|---|---|---|",
    ]
    left_off = []
    for label, rs in groups.items():
        if not all("diagnostics" in r for r in rs):
            continue
        if not all(normalised(r) for r in rs):
            left_off.append(label)
            continue
        cells = []
        for key, digits in (("entropy", 2), ("sink", 4)):
            for m, part in ((1, ""), (top, "_beyond")):
                ds = [r["diagnostics"][str(m * r["train_len"])] for r in rs]
                if any(d.get(f"{key}{part}") is None for d in ds):
                    cells.append("-")
                    continue
                iv = mean_ci([float(np.mean(d[f"{key}{part}"])) for d in ds])
                cells.append(f"{_fmt(iv, digits)} [{ds[0][f'uniform_{key}{part}']:.{digits}f}]")
        n = rs[0]["diagnostics"][str(rs[0]["train_len"])]["windows"]
        lines.append(f"| {label} | {n} x {len(rs)} | " + " | ".join(cells) + " |")
    note = (
        f" Left off: {', '.join(left_off)} (unnormalised: rows do not sum to 1, so entropy and "
        "mass do not compare)."
        if left_off
        else ""
    )
    return lines + [
        "",
        "Mean row entropy (nats) and mean attention mass on the window's first token, averaged "
        "over layers, heads, the rows named and the windows (spread over the split), ± the 95% "
        "interval over seeds: over every row at 1x, over the rows past the training length L "
        f"at {top}x (a mean over every row there is dominated by the early rows every length "
        "shares; the profile along the window is in entropy_sink_by_row.png). In brackets: the "
        "same for uniform attention over the visible keys (ln N_i, 1/N_i). A first-token mass "
        f"above the uniform one is an attention sink.{note}",
    ]


def _bucket(r: dict[str, Any], t: int, where: str) -> float | None:
    """One seed's passkey accuracy at length ``t`` over the probes whose key sits ``where``
    (within / beyond the training length); None without such probes."""
    b = r["passkey"].get("by_distance", {}).get(str(t), {}).get(where)
    return None if not b or not b["n"] else b["hits"] / b["n"]


def _passkey(groups, multiples, preset: Preset) -> list[str]:
    pk = {label: rs for label, rs in groups.items() if all("passkey" in r for r in rs)}
    if not pk:
        return []
    s = preset.passkey
    lines = [
        "## Passkey retrieval",
        "",
        f"A {s.digits}-digit key (chance {s.chance:.1%}: the first digit is 1-9) in real text "
        "at depth 10% / 50% / 90% of the context, greedy exact match, "
        f"{s.trials} probes per (length, depth) per seed. Every arm is first fine-tuned on probes "
        f"at the training length for the same {s.steps} steps ({s.warmup_steps} of warmup, "
        f"batch {s.batch_size}, lr {s.lr:g}, cosine decay; no early stop); an arm below "
        f"{s.target:.0%} at 1x on the test probes is *inconclusive* (not learned at the "
        "training length), not a result.",
        "",
        "| attention | learned at 1x (seeds) | " + " | ".join(f"{m}x" for m in multiples) + " |",
        "|---" * (len(multiples) + 2) + "|",
    ]
    acc: dict[str, dict[int, list[float]]] = {}
    far: dict[str, dict[int, list[float | None]]] = {}
    for label, rs in pk.items():
        rs = sorted(rs, key=lambda r: r["config"]["seed"])
        acc[label] = {
            m: [
                float(np.mean(list(r["passkey"]["accuracy"][str(m * r["train_len"])].values())))
                for r in rs
            ]
            for m in multiples
        }
        far[label] = {m: [_bucket(r, m * r["train_len"], "beyond") for r in rs] for m in multiples}
        learned = sum(a >= s.target for a in acc[label][1])
        cells = [mean_ci(acc[label][m]).fmt() + "%" for m in multiples]
        lines.append(f"| {label} | {learned}/{len(rs)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each cell: accuracy over every probe at that length (all depths), mean ± the 95% "
        "interval over seeds. Paper: softmax 64% / 0% / 0% vs LSSAR p=15 86% / 45% / 20% at 1x "
        "/ 1.5x / 4x.",
        "",
        "### By distance from the question",
        "",
        "*within*: the key sits at most L (the training length) tokens before the answer, a "
        "distance training showed (and a window of L sees); *beyond*: further back. At 1x every "
        "probe is within; beyond it the depths fall on either side, so the counts differ by "
        "length.",
        "",
        "| attention | " + " | ".join(f"{m}x within | {m}x beyond" for m in multiples[1:]) + " |",
        "|---" * (2 * len(multiples) - 1) + "|",
    ]
    for label, rs in pk.items():
        cells = []
        for m in multiples[1:]:
            for where in ("within", "beyond"):
                vals = [_bucket(r, m * r["train_len"], where) for r in rs]
                n = rs[0]["passkey"].get("by_distance", {}).get(str(m * rs[0]["train_len"]), {})
                count = n.get(where, {}).get("n", 0)
                ok = [v for v in vals if v is not None]
                cells.append("-" if len(ok) < len(vals) else f"{mean_ci(ok).fmt()}% (n={count})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each cell: mean ± 95% interval over seeds; n: probes per seed in that bucket. "
        "Verdicts below are on the *beyond* bucket (paired by seed; exploratory).",
        "",
    ]
    window = _find(acc, WINDOW)
    for base, name in ((SOFTMAX.label, "softmax"), (window, "the window control")):
        if base is None or base not in acc:
            continue
        for label in acc:
            if label == base or (base != SOFTMAX.label and label == SOFTMAX.label):
                continue
            for m in multiples[1:]:
                a, b = far[label][m], far[base][m]
                if any(x is None for x in a + b):
                    continue
                v = verdict(a, b, acc[label][1], acc[base][1], floor=s.target, names=(label, name))
                word = v.label
                if word == "inconclusive":
                    word += " (not learned at the training length)"
                lines.append(
                    f"- {label} vs {name} at {m}x, key beyond L: **{word}** -- {v.detail}."
                )
    return lines + [""]


def _provenance(results: list[dict[str, Any]], env: dict[str, Any]) -> tuple[str, list[str]]:
    """(the report's first line on where its numbers come from, the table of every result)."""
    train_shas = sorted({str(r["env"].get("git_sha")) for r in results})
    eval_shas = sorted({str(r.get("eval_env", {}).get("git_sha")) for r in results})
    n_runs = len({r["run"] for r in results})
    short = lambda shas: ", ".join(x[:10] for x in shas)  # noqa: E731
    dirty = [
        {"git_dirty": r["env"].get("git_dirty") or r.get("eval_env", {}).get("git_dirty")}
        for r in results
    ]
    head = provenance_head(dirty, env)
    head += (
        f" Training runs at commit {short(train_shas)} ({n_runs} runs); evaluations at "
        f"{short(eval_shas)}; this report at {str(env.get('git_sha'))[:10]}."
    )
    rows = [
        "| result | trained at | evaluated at | evaluation code |",
        "|---|---|---|---|",
    ]
    for r in results:
        t, e = r["env"], r.get("eval_env", {})
        mark = lambda x: str(x.get("git_sha"))[:10] + (" (dirty)" if x.get("git_dirty") else "")  # noqa: E731
        rows.append(
            f"| `{Path(r['run']).name / Path('eval', r.get('folder', ''), r.get('tag', '?'))}` | "
            f"{mark(t)} | {mark(e)} | "
            f"{r.get('eval_version', '?')} |"
        )
    return head, rows


def write_report(
    preset_name: str, preset: Preset, results: list[dict[str, Any]], out: Path, seconds: float
) -> Path:
    """REPORT.md, results.json and plots in ``out``, generated from the evaluation results."""
    groups = group(results)
    multiples = preset.multiples
    losses = _losses(groups, multiples)
    first = results[0]
    train_len = first["train_len"]
    cfg = first.get("config") or {}
    env = environment()
    head, prov_rows = _provenance(results, env)
    seeds = sorted({r["config"]["seed"] for r in results})
    lines = [
        f"# lssar reproduce --preset {preset_name}",
        "",
        head,
        "",
        f"{preset.description}. Generated by `lssar reproduce --preset {preset_name}` from the run "
        f"directories under `{Path(first['run']).parent}` on {dt.date.today().isoformat()} "
        f"({seconds / 60:.1f} min for this invocation; finished runs and evaluations are reused).",
        "",
        f"Setting: training length {train_len} tokens, {cfg.get('n_layer', '?')} layers, "
        f"{cfg.get('n_embd', '?')} wide, tokenizer `{cfg.get('tokenizer', '?')}`, corpus "
        f"`{cfg.get('corpus', '?')}`, {cfg.get('max_steps', '?')} steps, seeds {seeds}. "
        f"The sliding-window control is the softmax model evaluated with every query limited to "
        f"its last {train_len} keys (at the training length that is the causal mask, so it "
        "trains exactly as softmax).",
        "",
        "## Validation loss by evaluation length",
        "",
        *_loss_table(losses, multiples, groups),
        "",
        "## The paper (GPT-2 124M, FineWeb 10B, trained at 1024; METHOD.md section 7)",
        "",
        "| attention | " + " | ".join(f"{m}x" for m in multiples) + " |",
        "|---" * (len(multiples) + 1) + "|",
    ]
    for label, vals in PAPER.items():
        lines.append(
            f"| {label} | "
            + " | ".join(f"{vals[m]:.2f}" if m in vals else "-" for m in multiples)
            + " |"
        )
    one_seed = (
        ""
        if len(seeds) > 1
        else " With one seed there is no interval, so no claim can be supported or contradicted: "
        "run the `cpu` preset (3 seeds) for verdicts."
    )
    lines += [
        "",
        "## The paper's claims, judged from the intervals",
        "",
        f"At this scale ({cfg.get('n_layer', '?')}-layer, {cfg.get('n_embd', '?')}-wide "
        f"model, {train_len}-token training windows), not at the paper's. The claims below are "
        "the declared family: each is *supported* when the 95% interval over seeds (paired by "
        "seed for differences) lies wholly on its side of the criterion, *contradicted* when it "
        "lies wholly on the other side, else *within noise*; then Holm's correction over the "
        "whole list (on the t-test p-values against each criterion) keeps a verdict only if its "
        "test is still rejected, and each line says whether Holm changed it. A claim that two "
        f"arms *match* is supported only by an equivalence test (TOST, margin ±{LOSS_MARGIN} "
        f"loss or ±{RELATIVE_MARGIN:.0%} of a ratio), else it is *not separable at this power*. "
        f"Every other table below is exploratory: uncorrected 95% intervals.{one_seed}",
        "",
        *_claims(losses, multiples),
        "",
        "## What each ingredient does (a - b, paired by seed; exploratory)",
        "",
        *_diff_table(losses, multiples, DECOMPOSITION),
        "",
        "## Every arm against softmax (exploratory)",
        "",
        *_every_arm(losses, multiples, SOFTMAX.label),
        "",
    ]
    if LSSAR15.label in losses:
        lines += [
            "## Every arm against LSSAR p=15 (exploratory)",
            "",
            *_every_arm(losses, multiples, LSSAR15.label),
            "",
        ]
    lines += _alternatives(losses, multiples)
    if any("diagnostics" in r for r in results):
        lines += ["## Attention diagnostics", "", *_diagnostics(groups, multiples), ""]
    health = {k: rs for k, rs in groups.items() if all("numerical_health" in r for r in rs)}
    if health:
        lines += [
            f"## Numerical health at {max(multiples)}x (worst over seeds)",
            "",
            "| attention | bf16 non-finite | bf16 loss error | fp16 non-finite | fp16 loss error |",
            "|---|---|---|---|---|",
        ]
        for label, rs in health.items():
            h = [r["numerical_health"] for r in rs]
            cells = [
                f"{max(x[k]['nonfinite_logits'] for x in h)} | "
                f"{max(x[k]['abs_error_vs_fp64'] for x in h):.1e}"
                for k in ("bf16", "fp16")
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _passkey(groups, multiples, preset)
    lines += [
        "## Plots",
        "",
        "![loss vs length](loss_vs_length.png)",
        "![loss by position](loss_by_position.png)",
        "![entropy and first-token mass](entropy_sink_vs_length.png)",
        "![entropy and first-token mass by row position](entropy_sink_by_row.png)",
    ]
    if any("passkey" in r for r in results):
        lines.append("![passkey](passkey.png)")
    lines += [
        "",
        "## Provenance",
        "",
        *prov_rows,
        "",
        "This invocation's environment:",
        "",
        "```",
        json.dumps(env, indent=1),
        "```",
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    plot_results(results, out)
    summary = {
        label: {str(m): _iv(v[m]).__dict__ for m in multiples} for label, v in losses.items()
    }
    data = {"preset": preset_name, "results": results, "summary": summary}
    return write_files(out, lines, data)
