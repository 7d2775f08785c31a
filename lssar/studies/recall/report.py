"""REPORT.md, results.json and plots of the recall study, generated from the tidy rows only
(plus, for the attention-map figure, the trained models of the first seed); the figures are
:mod:`.plots`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from lssar.studies.common import conditions, environment_section, provenance_head
from lssar.studies.common import write_report as write_files
from lssar.studies.labels import eval_label
from lssar.studies.recall.plots import plot_accuracy, plot_attention_maps
from lssar.studies.recall.presets import ARMS, EVAL_PS
from lssar.studies.stats import mean_ci, verdict

# the practitioner's alternatives, as row labels: trained arms and eval-only rules
ALTERNATIVES = [
    label
    for a in ARMS.values()
    if a.pos != "rope" or not a.own_rule
    for label in ([a.name] if a.own_rule else [eval_label(a, r) for r in a.evals])
]
# the order of the rows (and of the arms in a figure's panels)
_ORDER = (
    [name for name, a in ARMS.items() if a.own_rule and name not in ALTERNATIVES]
    + [eval_label(ARMS["lssa"], p) for p in EVAL_PS]
    + ALTERNATIVES
)


def _cells(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[int, dict[str, Any]]]:
    """(arm, multiple, distance) -> {seed: row}."""
    out: dict = defaultdict(dict)
    for r in rows:
        out[(r["arm"], r["length_multiple"], r["distance"])][r["seed"]] = r
    return out


def _arms(rows) -> list[str]:
    seen = list(dict.fromkeys(r["arm"] for r in rows))
    return sorted(seen, key=lambda a: _ORDER.index(a) if a in _ORDER else len(_ORDER))


def _accs(cells, arm, m, dist) -> list[float] | None:
    c = cells.get((arm, m, dist))
    return None if not c else [c[s]["accuracy"] for s in sorted(c)]


def _table(cells, arms, multiples, dist) -> list[str]:
    lines = [
        "| arm | " + " | ".join(f"{m}x" for m in multiples) + " |",
        "|---" * (len(multiples) + 1) + "|",
    ]
    for a in arms:
        cs = []
        for m in multiples:
            c = cells.get((a, m, dist))
            if not c:
                cs.append("-")
                continue
            iv = mean_ci([r["accuracy"] for r in c.values()])
            q = sorted({r["queries"] for r in c.values()})
            cs.append(f"{iv.fmt()} [{'/'.join(map(str, q))}]")
        lines.append(f"| {a} | " + " | ".join(cs) + " |")
    return lines


def _compare(cells, a, b, multiples, dist) -> tuple[str, str] | None:
    """The verdicts of a vs b at each multiple: (table row, a sentence for the longest length);
    None if an arm is missing."""
    if not any((a, 1, "all") == k[:3] for k in cells) or not any(
        (b, 1, "all") == k[:3] for k in cells
    ):
        return None
    out, last = [], ""
    for m in multiples:
        xa, xb = _accs(cells, a, m, dist), _accs(cells, b, m, dist)
        if xa is None or xb is None:
            out.append("-")
            continue
        v = verdict(xa, xb, _accs(cells, a, 1, "all"), _accs(cells, b, 1, "all"), names=(a, b))
        win = a if v.better == "a" else b
        head = v.label if v.label != "supported" else f"**supported: {win}**"
        ma, mb = sum(xa) / len(xa), sum(xb) / len(xb)
        out.append(f"{head} ({100 * ma:.0f} vs {100 * mb:.0f})")
        last = f"- {a} vs {b}, {m}x, {dist}: **{v.label}** -- {v.detail}."
    return f"| {a} vs {b} | {dist} | " + " | ".join(out) + " |", last


def _question(cells, title, pairs, multiples, dist="beyond") -> list[str]:
    lines = [f"### {title}", ""]
    found = [r for a, b in pairs if (r := _compare(cells, a, b, multiples, dist))]
    if not found:
        return lines + ["Not measured in this run (an arm is missing).", ""]
    return lines + [
        "| comparison | distance | " + " | ".join(f"{m}x" for m in multiples) + " |",
        "|---" * (len(multiples) + 2) + "|",
        *(row for row, _ in found),
        "",
        f"At the longest length ({max(multiples)}x):",
        "",
        *(sentence for _, sentence in found),
        "",
    ]


def _best(cells, candidates: list[str], top: int, dist: str = "beyond") -> list[str]:
    """The candidate with the highest mean accuracy at ``top`` on ``dist``, named the best only
    when its paired verdict against every other candidate is *supported* (else: which are not
    separable from it)."""
    accs = {a: x for a in candidates if (x := _accs(cells, a, top, dist)) is not None}
    if len(accs) < 2:
        return []
    best = max(accs, key=lambda a: sum(accs[a]) / len(accs[a]))
    head = (
        f"Highest mean accuracy at {top}x ({dist}) among {', '.join(accs)}: **{best}**, "
        f"{mean_ci(accs[best]).fmt()}%"
    )
    one = lambda a: _accs(cells, a, 1, "all")  # noqa: E731
    results = {
        a: verdict(accs[best], accs[a], one(best), one(a), names=(best, a))
        for a in accs
        if a != best
    }
    if any(v.label in ("no interval", "inconclusive") for v in results.values()):
        open_ = [a for a, v in results.items() if v.label in ("no interval", "inconclusive")]
        return [f"{head}; no verdict against {', '.join(open_)} (one seed or not learned).", ""]
    close = [a for a, v in results.items() if v.label != "supported"]
    if not close:
        return [f"{head}: the best, beyond noise, against every other (paired by seed).", ""]
    return [f"{head}, but **not separable** from {', '.join(close)} at this power.", ""]


def _provenance(meta: dict[str, Any]) -> list[str]:
    """Where the numbers come from: the commits of the training runs and of this report, the
    dirty flags, and the training time summed over the models."""
    runs = {r["run"]: r for r in meta["runs"]}.values()  # one entry per trained model
    shas = sorted({str(r.get("git_sha")) for r in runs})
    env = meta.get("env", {})
    secs = sum(r.get("train_seconds") or 0.0 for r in runs)
    return [
        provenance_head(list(runs), env)
        + f" Training runs: commit {', '.join(shas)}; report: commit {env.get('git_sha')}. "
        f"{len(runs)} models, {secs / 60:.1f} min of training summed over them "
        f"({meta['config'].get('jobs', 1)} worker processes). " + conditions(list(runs))
    ]


def write_report(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    out: Path,
    models: dict[str, Any] | None = None,
    cfg: Any = None,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cells = _cells(rows)
    arms = _arms(rows)
    multiples = sorted({r["length_multiple"] for r in rows})
    longer = [m for m in multiples if m > 1]
    seeds = sorted({r["seed"] for r in rows})
    c = meta["config"]
    task = c["task"]
    L = task["train_len"]
    one_seed = len(seeds) < 2
    shift = (
        ", with a token shift at the input (each position also embeds the token before it, so "
        "retrieval takes one attention hop; see `lssar/studies/recall/model.py`); "
        if c.get("token_shift")
        else "; "
    )
    low = [a for a in arms if (x := _accs(cells, a, 1, "all")) and sum(x) / len(x) < 0.9]
    lines = [
        f"# lssar recall --preset {meta['preset']}",
        "",
        f"Multi-query associative recall trained from scratch at L = {L} tokens and tested at "
        f"{', '.join(f'{m}x' for m in multiples)} L with the same {task['n_pairs']} key-value "
        f"pairs and {task['n_queries']} queries per sequence (only distractors and distances "
        f"grow). Generated by `lssar recall` on {meta['date']} in {meta['seconds'] / 60:.1f} min "
        "(finished runs are reused), from the rows in `results.json`.",
        "",
        *_provenance(meta),
        "",
        f"Setting: {c['n_layer']} layers, {c['n_embd']} wide, {c['n_head']} heads, RoPE, fp32"
        + shift
        + f"{c['steps']} steps of {c['batch_size']} sequences, AdamW lr {c['lr']:g} (warmup "
        f"{c['warmup']}, cosine to 10%); vocabulary {task['n_keys']} keys, {task['n_values']} "
        f"values, {task['n_filler']} filler tokens; seeds {seeds}; {c['eval_seqs']} evaluation "
        "sequences per length, the same for every arm. Loss and accuracy on the answer tokens "
        "only (argmax of the next-token prediction at each queried key).",
        "",
        f"Distance buckets: *within* = the key sits < {L} tokens before its query (distances "
        f"training saw), *beyond* = >= {L}. Beyond 1x the queried pairs are stratified: half "
        "within, half beyond, so *all* is an even mix of the two.",
        "",
        "Cells: accuracy % (mean over seeds ± the t-based 95% half-interval; with one seed, the "
        "mean only) and [scored queries per seed].",
        "",
    ]
    lines += [
        f"Chance: answering with a random one of the {task['n_pairs']} values in the sequence "
        f"scores {100 / task['n_pairs']:.1f}%; fewer visible values (the window control) raise it.",
        "",
    ]
    if (out / "PILOT.md").exists():
        lines += ["The pilot that sized this study: [PILOT.md](PILOT.md).", ""]
    if one_seed:
        lines += [
            "**One seed: no confidence intervals are available, so no verdict below is "
            '"supported"; read the numbers as a smoke test of the pipeline, not a finding.**',
            "",
        ]
    if low:
        lines += [
            f"**Below 90% at 1x (their extrapolation is inconclusive): {', '.join(low)}.**",
            "",
        ]
    lines += ["## Accuracy by length (all distances)", "", *_table(cells, arms, multiples, "all")]
    lines += ["", "## Distance split", ""]
    for dist in ("within", "beyond"):
        lines += [f"### {dist} {L} tokens", "", *_table(cells, arms, multiples, dist), ""]
    lines += [
        "## Questions and verdicts",
        "",
        "A difference is **supported** only when the 95% t-interval of the per-seed "
        "differences (paired by seed) excludes 0; otherwise *within noise*, which is not a tie; "
        "*no interval* with one seed; *inconclusive* when an arm is "
        "below 90% at 1x. Cells give the verdict and the two mean accuracies (%), on the "
        "*beyond* bucket (the distances training never showed) unless marked.",
        "",
    ]
    lines += _question(
        cells,
        "1. Does LSSAR retrieve beyond L where softmax fails?",
        [("lssar p=15", "softmax"), ("lssar p=3", "softmax")],
        longer,
    )
    lines += _question(
        cells,
        "2. Re-weighting or length scale? (LSSAR vs softmax-qknorm-logn: same ln N scale; "
        "LSSA vs LSSAR: same scale, with/without re-weighting; softmax-qknorm-logn and ssmax "
        "vs softmax: a length scale alone)",
        [
            ("lssar p=15", "softmax-qknorm-logn"),
            ("lssar p=15", "lssa"),
            ("lssar p=3", "softmax-qknorm-logn"),
            ("lssar p=3", "lssa"),
            ("softmax-qknorm-logn", "softmax"),
            ("ssmax", "softmax"),
        ],
        longer,
    )
    sweep = [a for a in arms if a.startswith("lssa -> ")]
    lines += _question(
        cells,
        "3. Does eval-time re-weighting help an LSSA-trained model, and at which p?",
        [(a, "lssa") for a in sweep],
        longer,
    )
    if sweep:
        top = max(multiples)
        for dist in ("beyond", "all"):
            best = max(sweep, key=lambda a: sum(_accs(cells, a, top, dist) or [0]))
            mean = mean_ci(_accs(cells, best, top, dist) or [0.0])
            lines.append(
                f"Highest mean accuracy at {top}x ({dist}): {best}, {mean.fmt()}% "
                "(the verdicts above say whether it beats lssa's own rule)."
            )
        lines.append("")
    lines += _question(
        cells,
        f"4. Is any arm better than the window control (softmax restricted to the last {L} keys)?",
        [(a, "window") for a in arms if a != "window"],
        longer,
        dist="all",
    )
    alternatives = [a for a in ALTERNATIVES if a in arms]
    if alternatives:
        lines += _question(
            cells,
            "5. LSSAR against the practitioner's alternatives (ALiBi, NoPE, and RoPE rescaled "
            "at evaluation only: PI, NTK, dynamic NTK, YaRN at factor = the length multiple)",
            [("lssar p=15", a) for a in alternatives],
            longer,
        )
        lines += _best(cells, ["lssar p=15", "softmax", *alternatives], max(multiples))
    lines += [
        "The window control cannot see a pair more than L tokens back, so *beyond* L it answers "
        "with a value it can see (≈ 0%), and *within* L it shows what locality alone achieves; "
        "on *all* (half within, half beyond) it sits near 50%.",
        "",
        "## Training",
        "",
        "| arm | seed | final train accuracy | train seconds | run |",
        "|---|---|---|---|---|",
    ]
    for r in meta["runs"]:
        acc = r.get("final_train_acc")
        secs = r.get("train_seconds")
        lines.append(
            f"| {r['arm']} | {r['seed']} | {'-' if acc is None else f'{100 * acc:.1f}%'} | "
            f"{'-' if secs is None else f'{secs:.0f}'} | `{r['run']}` |"
        )
    lines += [
        "",
        "## Plots",
        "",
        "Colours and line styles are every report's (one per arm: the LM and orbits reports "
        "draw the same arm alike); the dotted black line is chance.",
        "",
        "![accuracy vs length](accuracy_vs_length.png)",
        "![distance split](distance_split.png)",
    ]
    plot_accuracy(cells, arms, out, chance=1 / task["n_pairs"])
    if models:
        plot_attention_maps(models, cfg, out)
        lines.append("![attention maps](attention_maps.png)")
    lines += ["", *environment_section(meta.get("env", {}))]
    return write_files(out, lines, {"rows": rows, "meta": meta})


# ----------------------------------------------------------------------------------- pilot

LEARNED = 0.99  # mean train accuracy over a logged 50-step window that counts as learned


def write_pilot(models: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> Path:
    """``PILOT.md`` + ``pilot.json`` of :func:`lssar.studies.recall.study.run_pilot`: per
    trained model its train accuracy against step and the first step it reached
    :data:`LEARNED` (or that it did not within the budget)."""
    c, task = meta["config"], meta["config"]["task"]
    envs = [m["env"] for m in models]
    steps = [e["step"] for e in models[0]["log"]] if models else []
    shown = steps[:: max(1, len(steps) // 10)] + ([steps[-1]] if steps else [])
    shown = list(dict.fromkeys(shown))
    lines = [
        f"# lssar recall --pilot (preset {meta['preset']})",
        "",
        provenance_head(envs, meta["env"])
        + f" Training at commit {', '.join(sorted({str(e.get('git_sha'))[:10] for e in envs}))}.",
        "",
        f"Command: `{meta['command']}` on {meta['date']} "
        f"({meta['seconds'] / 60:.1f} min; finished runs are reused). Training only: train "
        "accuracy on the answer tokens, averaged over each logged 50-step window.",
        "",
        f"Setting: L = {task['train_len']}, {task['n_pairs']} pairs, {task['n_queries']} "
        f"queries, {task['n_keys']} keys / {task['n_values']} values / {task['n_filler']} "
        f"fillers; {c['n_layer']} layers x {c['n_embd']} wide x {c['n_head']} heads, token "
        f"shift {'on' if c['token_shift'] else 'off'}; {c['steps']} steps of {c['batch_size']}, "
        f"lr {c['lr']:g}, warmup {c['warmup']}, weight decay {c['weight_decay']:g}.",
        "",
        "| model | seed | learned (>= 99%) | "
        + " | ".join(f"step {s}" for s in shown)
        + " | train s |",
        "|---" * (len(shown) + 4) + "|",
    ]
    verdicts = []
    for m in models:
        acc = {e["step"]: e["acc"] for e in m["log"]}
        first = next((s for s in sorted(acc) if acc[s] >= LEARNED), None)
        learned = f"step {first}" if first is not None else f"no (in {c['steps']} steps)"
        verdicts.append(first is not None)
        secs = m.get("train_seconds")
        lines.append(
            f"| {' = '.join(m['arms'])} | {m['seed']} | {learned} | "
            + " | ".join(f"{100 * acc[s]:.1f}%" if s in acc else "-" for s in shown)
            + f" | {'-' if secs is None else f'{secs:.0f}'} |"
        )
    lines += [
        "",
        f"{sum(verdicts)} of {len(verdicts)} models learned the task in this budget.",
        "",
        *environment_section(meta["env"]),
    ]
    return write_files(out, lines, {"models": models, "meta": meta}, "PILOT.md", "pilot.json")
