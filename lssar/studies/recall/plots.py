"""The figures of ``lssar recall``'s report: accuracy against length (all distances, and split
within / beyond the training length), and one query's attention at the longest length. Colours
and line styles are :mod:`lssar.studies.style`'s (the same arm, the same colour, as in the LM
and orbits reports); many arms are split into panels by family (:func:`~lssar.studies.style.
facets`), each with its legend under it and the chance of answering at random."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lssar.studies.labels import eval_label
from lssar.studies.recall.presets import EVAL_SEED, eval_ps
from lssar.studies.stats import mean_ci
from lssar.studies.style import colour, facets, grid, legend_below, linestyle, spread

Cells = dict[
    tuple[str, int, str], dict[int, dict[str, Any]]
]  # (arm, multiple, distance) -> seed -> row


def _series(cells: Cells, arm: str, multiples: list[int], dist: str):
    """The arm's mean accuracy (%) at each multiple it has, with the 95% half-interval over
    seeds (0 with one seed)."""
    xs, ys, es = [], [], []
    for m in multiples:
        c = cells.get((arm, m, dist))
        if not c:
            continue
        iv = mean_ci([c[s]["accuracy"] for s in sorted(c)])
        xs.append(m)
        ys.append(100 * iv.mean)
        es.append(0.0 if iv.half is None else 100 * iv.half)
    return xs, ys, es


def _panel(ax, cells: Cells, facet, multiples: list[int], dist: str, chance: float | None):
    """One panel: the facet's arms (bold) and references (thin), accuracy vs length."""
    for a in facet.lines:
        xs, ys, es = _series(cells, a, multiples, dist)
        if not xs:
            continue
        ref = a in facet.refs
        ax.errorbar(
            xs, ys, yerr=es, marker="o", ms=3 if ref else 5, capsize=2 if ref else 3,
            lw=1 if ref else 1.5, alpha=0.6 if ref else 1.0, color=colour(a), ls=linestyle(a),
            label=f"{a} (ref.)" if ref else a,
        )  # fmt: skip
    if chance is not None:
        ax.axhline(100 * chance, color="black", lw=0.8, ls=(0, (1, 2)))
        ax.text(
            0.99, 100 * chance, f"chance {100 * chance:.0f}%", transform=ax.get_yaxis_transform(),
            ha="right", va="bottom", fontsize=7,
        )  # fmt: skip
    ax.set(xscale="log", ylim=(-2, 102))
    ax.set_xticks(multiples, [f"{m}x" for m in multiples])
    ax.minorticks_off()
    ax.grid(alpha=0.3)


def plot_accuracy(
    cells: Cells, arms: list[str], out: Path, chance: float | None = None
) -> list[str]:
    """``accuracy_vs_length.png`` (all distances) and ``distance_split.png`` (within / beyond
    the training length) in ``out``: accuracy (%) against length per arm, the mean over seeds
    with its 95% t-interval; ``chance`` (a fraction) as a line. Returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiples = sorted({m for _, m, _ in cells})
    panels = facets(arms)
    n_seeds = spread(
        [len(cells[(a, 1, "all")]) for a in arms if (a, 1, "all") in cells], "interval"
    )
    many = len(panels) > 1
    nrow, ncol = grid(len(panels))
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(4.4 * ncol + 2.8 * (not many), (3.1 + 1.1 * many) * nrow),
        squeeze=False, sharey=True, layout="constrained",
    )  # fmt: skip
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, facet in zip(axes.flat, panels):
        _panel(ax, cells, facet, multiples, "all", chance)
        ax.set(xlabel="evaluation length / training length", ylabel="accuracy (%)")
        if facet.title:
            ax.set_title(facet.title, fontsize=9)
        if many:
            legend_below(ax)
    if not many:
        fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside right center", fontsize=8)
    fig.suptitle(f"Associative recall: accuracy vs length, all distances ({n_seeds})", fontsize=10)
    fig.savefig(out / "accuracy_vs_length.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(
        2, len(panels), figsize=(4.4 * len(panels) + 2.8 * (not many), 6.4 + 1.1 * many),
        squeeze=False, sharey=True, layout="constrained",
    )  # fmt: skip
    for col, facet in enumerate(panels):
        for row, dist in enumerate(("within", "beyond")):
            ax = axes[row, col]
            _panel(ax, cells, facet, multiples, dist, chance)
            ax.set_ylabel(f"accuracy (%), key {dist} L")
        axes[0, col].set_title(facet.title, fontsize=9)
        axes[1, col].set_xlabel("evaluation length / training length")
        if many:
            legend_below(axes[1, col])
    if not many:
        fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside right center", fontsize=8)
    fig.suptitle(
        f"Key-query distance within (top) and beyond (bottom) the training length L ({n_seeds})",
        fontsize=10,
    )
    fig.savefig(out / "distance_split.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return ["accuracy_vs_length.png", "distance_split.png"]


def _pair(cfg, key_pos: int) -> list[int]:
    """The two positions of a stored pair: its key and its value (kv: value after the key)."""
    return [key_pos, key_pos + (1 if cfg.task.pair_order == "kv" else -1)]


@torch.no_grad()
def retrieval_layer(model, cfg, arm) -> int:
    """The layer whose attention (mean over heads) puts the most weight on the queried pair at
    the training length, with the model's own rule: where the retrieval happens."""
    L = cfg.task.train_len
    b = cfg.task.batch((EVAL_SEED, 1, 0), L, 20)
    ws: list = []
    model(b["tokens"], weights=ws, window=L if arm.window else None)
    score = []
    for w in ws:  # (B, H, T, T)
        w = w.float().mean(1)  # (B, T, T)
        tot = 0.0
        for i in range(b["query_pos"].shape[0]):
            for q, k in zip(b["query_pos"][i].tolist(), b["key_pos"][i].tolist()):
                tot += float(w[i, q, _pair(cfg, k)].sum())
        score.append(tot)
    return int(max(range(len(score)), key=score.__getitem__))


@torch.no_grad()
def plot_attention_maps(models: dict[str, Any], cfg, out: Path) -> str:
    """One query's weights (mean over heads) over a sequence at the longest length, one panel
    per arm (and the LSSA model with eval-time p=15 when it is in the study), in the layer that
    retrieves (:func:`retrieval_layer`), every panel on one y-scale; ``attention_maps.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = cfg.task.train_len
    mult = max(cfg.multiples)
    T = mult * L
    b = cfg.task.batch((EVAL_SEED, mult, 0), T, 1)
    j = cfg.task.n_queries - 1  # the last query is in the "beyond" bucket when T > L
    q, k = int(b["query_pos"][0, j]), int(b["key_pos"][0, j])
    panels = []
    for name, (model, arm) in models.items():
        if not arm.own_rule:  # eval-only rules on another arm's model: not a model of its own
            continue
        panels.append((name, model, arm, None))
        if eval_ps(arm):
            panels.append((eval_label(arm, 15.0), model, arm, 15.0))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 1.6 * len(panels) + 0.6), sharex=True, sharey=True,
        squeeze=False,
    )  # fmt: skip
    for ax, (label, model, arm, p) in zip(axes[:, 0], panels):
        layer = retrieval_layer(model, cfg, arm)
        if p is not None:
            model.set_attention("lssar", {"p": p})
        ws: list = []
        logits, _ = model(b["tokens"], weights=ws, window=L if arm.window else None)
        model.set_attention(arm.attention.name, dict(arm.attention.options))
        w = ws[layer][0, :, q, : q + 1].float().mean(0).numpy()
        ok = int(logits[0, q].argmax()) == int(b["answer"][0, j])
        ax.plot(range(q + 1), w, color=colour(label), lw=0.8)
        ax.axvline(k, color="k", ls=":", lw=1)
        ax.axvspan(q - L + 1, q, color="0.9", zorder=0)
        ax.set_ylabel("weight", fontsize=7)
        ax.set_title(
            f"{label} (layer {layer + 1}): weight on the queried pair "
            f"{w[_pair(cfg, k)].sum():.2f}, answer {'correct' if ok else 'wrong'}",
            fontsize=8,
            loc="left",
        )
    axes[0, 0].set_ylim(bottom=0)
    axes[-1, 0].set_xlabel(
        f"key position (query at {q}; dotted: the queried pair at {k}, "
        f"distance {q - k}; grey: the last {L} tokens)"
    )
    fig.suptitle(
        f"Attention of one query at {mult}x (mean over heads, in the layer that retrieves at "
        "1x; one y-scale)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out / "attention_maps.png", dpi=110)
    plt.close(fig)
    return "attention_maps.png"
