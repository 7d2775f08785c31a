"""The figures of ``lssar orbits``' report: the force probes' predictions and the power-law
exponents against their noise ceilings. One colour per arm (:func:`lssar.studies.style.colour`:
the LM and recall reports' colour of the same arm; ``lssar`` is LSSAR p=15, ``softmax-local``
the window control), legends outside the axes, intervals over seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lssar.studies.orbits.ceiling import EXPONENTS, TARGET
from lssar.studies.orbits.judging import Result, by_seed
from lssar.studies.stats import mean_ci
from lssar.studies.style import colour, spread

LABELS = {"alpha": "α (m1)", "beta": "β (m2)", "gamma": "γ (r)", "max_err": "max exponent error"}


def force_scatter(results: list[Result], out: Path, first_step: int) -> str | None:
    """Predicted vs true ``log |F|`` on the test systems, one panel per model arm (its first
    seed); ``out/force_scatter.png``, or None without a model arm."""
    import matplotlib.pyplot as plt

    arms = [
        (a, runs[min(runs)]) for a, runs in by_seed(results).items() if runs[min(runs)]["probe"]
    ]
    if not arms:
        return None
    cols = min(4, len(arms))
    rows = -(-len(arms) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.3 * rows), squeeze=False)
    for ax in axes.ravel()[len(arms) :]:
        ax.axis("off")
    for ax, (arm, r) in zip(axes.ravel(), arms):
        with np.load(Path(r["run_dir"]) / "predictions.npz", allow_pickle=False) as z:
            y, yh = z["log_f_true"].ravel(), z["log_f_pred"].ravel()
        sel = np.random.default_rng(0).choice(len(y), min(3000, len(y)), replace=False)
        ax.scatter(y[sel], yh[sel], s=3, alpha=0.4, color=colour(arm))
        lim = [min(y.min(), yh.min()), max(y.max(), yh.max())]
        ax.plot(lim, lim, "k--", lw=0.8)
        ax.set_title(f"{arm} (seed {r['seed']}): R² {r['probe']['test_r2']:.3f}", fontsize=9)
        ax.set_xlabel("true log |F|")
        ax.set_ylabel("predicted log |F|")
    fig.suptitle(f"Force probe on held-out systems (steps ≥ {first_step})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "force_scatter.png", dpi=110)
    plt.close(fig)
    return "force_scatter.png"


def _point(ax: Any, x: float, vals: list[float], c: str) -> None:
    """Each seed (small, hollow) and the mean with its 95% t interval over seeds (bold)."""
    ax.scatter([x] * len(vals), vals, s=12, facecolors="none", edgecolors=c, lw=0.8, zorder=3)
    iv = mean_ci(vals)
    yerr = None if iv.lo is None else [[iv.mean - iv.lo], [iv.hi - iv.mean]]
    ax.errorbar(x, iv.mean, yerr=yerr, fmt="D", ms=5, capsize=3, color=c, lw=1.6, zorder=4)


def exponents(results: list[Result], out: Path) -> str:
    """``out/exponents.png``: per arm, α, β, γ and the largest exponent error of the power law
    (seeds and their mean with a 95% t interval), over the arm's noise ceiling drawn as a grey
    band (exponents: the 2.5-97.5 percentiles of the ceiling's draws, the union over seeds;
    largest error: the ceiling's mean with its interval over seeds)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    arms = by_seed(results)
    names = list(arms)
    fig, axes = plt.subplots(2, 2, figsize=(5.2 * 2, 3.6 * 2))
    for ax, k in zip(axes.ravel(), [*EXPONENTS, "max_err"]):
        for i, arm in enumerate(names):
            rs = [arms[arm][s] for s in sorted(arms[arm])]
            ceils = [r["ceiling"] for r in rs if r.get("ceiling")]
            if ceils and len(ceils) == len(rs):
                if k == "max_err":
                    iv = mean_ci([c["max_err"] for c in ceils])
                    lo, hi = (iv.mean, iv.mean) if iv.lo is None else (iv.lo, iv.hi)
                else:
                    lo = min(c["band"][k][0] for c in ceils)
                    hi = max(c["band"][k][1] for c in ceils)
                if hi - lo > 0:
                    ax.add_patch(
                        plt.Rectangle((i - 0.35, lo), 0.7, hi - lo, color="0.8", lw=0, zorder=1)
                    )
                else:  # one seed: the ceiling's mean, as a thick line
                    ax.hlines(lo, i - 0.35, i + 0.35, color="0.7", lw=3, zorder=1)
            vals = [r["sr"]["errors" if k == "max_err" else "power_law"][k] for r in rs]
            _point(ax, i, vals, colour(arm))
        ax.axhline(0.0 if k == "max_err" else TARGET[EXPONENTS.index(k)], color="k", lw=0.8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_title(
            LABELS[k] + ("" if k == "max_err" else f": Newton {TARGET[EXPONENTS.index(k)]:g}"),
            fontsize=9,
        )
    what = spread([len(runs) for runs in arms.values()], "interval")
    handles = [
        Line2D([], [], marker="D", color="0.3", lw=1.6, label=what.replace(", ", ",\n", 1)),
        Line2D([], [], marker="o", mfc="none", color="0.3", ls="", label="one seed"),
        Patch(color="0.8", label="noise ceiling: exact law\n+ this arm's probe noise"),
        Line2D([], [], color="k", lw=0.8, label="Newton (1, 1, −2)"),
    ]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("Power-law exponents of the predicted forces against their noise ceilings")
    fig.tight_layout()
    fig.savefig(out / "exponents.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "exponents.png"


def write_plots(results: list[Result], out: Path, first_step: int) -> list[str]:
    """Both figures in ``out``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    names = [force_scatter(results, out, first_step), exponents(results, out)]
    return [n for n in names if n]
