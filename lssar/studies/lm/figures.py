"""Figures of an evaluation (``lssar eval``) and of ``lssar reproduce``'s report.

Results are grouped by arm (:func:`label_of`: one group holds that arm's seeds). Every figure
draws an arm in the same colour, with the line style of its family (softmax-normalised solid,
pointwise dash-dot, Softplus-l1 dashed, eval-time switches dotted), the mean over seeds with a
95% band (t over seeds, :func:`lssar.studies.stats.mean_ci`), and one legend outside the axes.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from lssar.ops.variants import VARIANTS
from lssar.spec import run_label
from lssar.studies.stats import mean_ci

Result = dict[str, Any]

# one colour per arm of the paper's comparison (and of the controls); others get a stable one
COLOURS = {
    "softmax": "#1f77b4",
    "softmax, sliding window": "#17becf",
    "softmax-qknorm-logn": "#9467bd",
    "ssmax": "#8c564b",
    "sigmoid": "#7f7f7f",
    "relu": "#bcbd22",
    "softplus-l1": "#ff7f0e",
    "lssa": "#2ca02c",
    "lssar p=3": "#e377c2",
    "lssar p=15": "#d62728",
    # the decomposition (issue #25); constant-scale labels carry their n, dropped for the colour
    "softmax-qknorm-const": "#c5b0d5",
    "softmax-qknorm-learned": "#5254a3",
    "lssa-const": "#98df8a",
    "softmax-qknorm-logn p=15": "#843c39",
    "lssa -> lssar p=1 (eval only)": "#b7e4a7",
    "lssa -> lssar p=3 (eval only)": "#74c476",
    "lssa -> lssar p=8 (eval only)": "#31a354",
    "lssa -> lssar p=15 (eval only)": "#00441b",
    # the practitioner's alternatives (issue #24)
    "softmax + alibi": "#e6550d",
    "softmax + nope": "#636363",
    "lssar p=15 + nope": "#fd8d3c",
    "softmax -> linear auto (eval only)": "#6baed6",
    "softmax -> ntk auto (eval only)": "#3182bd",
    "softmax -> dynamic-ntk auto (eval only)": "#08519c",
    "softmax -> yarn auto (eval only)": "#08306b",
}
_SPARE = ["#393b79", "#ad494a", "#8c6d31", "#637939", "#7b4173", "#3182bd", "#e6550d"]
_POINTWISE = ("sigmoid", "relu")


def normalised(r: Result) -> bool:
    """Whether the evaluated rule's rows sum to 1 (every l1 variant): entropy and first-token
    mass compare across arms only then, so the unnormalised ones (sigmoid, relu) are left off
    those axes."""
    v = VARIANTS.get(str(r["evaluated_attention"]).split(" ")[0])
    return v is None or v.l1


def label_of(r: Result) -> str:
    """The arm of a result: the trained rule (``"softmax + alibi"`` with its positions),
    ``"lssa -> lssar p=15 (eval only)"`` for a rule switched after training, ``"softmax -> yarn
    auto (eval only)"`` for a RoPE scaling, ``"softmax, sliding window 128"`` for the window
    control."""
    label = run_label(r["trained_attention"], r["evaluated_attention"], r.get("rope_scaling"))
    return label if not r.get("window") else f"{label}, sliding window {r['window']}"


def style(label: str) -> dict[str, str]:
    """Matplotlib ``color`` and ``ls`` of an arm, the same in every figure."""
    key = label.split(" window")[0] + " window" if ", sliding window" in label else label
    key = re.sub(r" n=\d+", "", key)  # a constant-scale arm's length: one colour at any L
    colour = COLOURS.get(key) or _SPARE[zlib.crc32(label.encode()) % len(_SPARE)]
    if "(eval only)" in label:
        ls = ":"
    elif label.split(" ")[0] in _POINTWISE:
        ls = "-."
    elif label.startswith(("lssa", "softplus")):
        ls = "--"
    else:
        ls = "-"
    return {"color": colour, "ls": ls}


def group(results: list[Result]) -> dict[str, list[Result]]:
    """Arm label -> its results (one per seed), in first-seen order."""
    out: dict[str, list[Result]] = {}
    for r in results:
        out.setdefault(label_of(r), []).append(r)
    return out


def _band(ax, xs, per_seed: list[list[float]], label: str, marker: str | None = "o") -> None:
    """Mean over seeds (``per_seed[i][k]``: seed i at point k) and its 95% band."""
    ivs = [mean_ci([s[k] for s in per_seed]) for k in range(len(xs))]
    st = style(label)
    ax.plot(xs, [iv.mean for iv in ivs], marker=marker, ms=4, label=label, **st)
    if ivs[0].lo is not None:
        ax.fill_between(
            xs, [iv.lo for iv in ivs], [iv.hi for iv in ivs], color=st["color"], alpha=0.15, lw=0
        )


def _beyond(d: dict[str, Any], key: str) -> Any:
    """A diagnostic over the rows beyond the training length, or over every row at 1x (where
    none is beyond)."""
    far = d.get(f"{key}_beyond")
    return d[key] if far is None else far


def _save(fig, path: Path, paths: list[Path], legend_ax=None) -> None:
    import matplotlib.pyplot as plt

    src = legend_ax if legend_ax is not None else fig.axes[0]
    handles, labels = src.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    paths.append(path)


def plot_results(results: list[Result], out_dir: Path) -> list[Path]:
    """Loss vs length, loss by position, entropy/first-token mass vs length (with the uniform
    attention values) and a passkey grid per arm, as PNG files in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    groups, paths = group(results), []

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rs in groups.items():
        lengths = list(rs[0]["loss"])
        xs = [int(t) / rs[0]["train_len"] for t in lengths]
        _band(ax, xs, [[r["loss"][t] for t in lengths] for r in rs], label)
    ax.set(xscale="log", xlabel="evaluation length / training length", ylabel="validation loss")
    ax.set_xticks(xs, [f"{x:g}x" for x in xs])
    several = any(len(rs) > 1 for rs in groups.values())
    what = "mean, 95% band over seeds" if several else "one seed: no band"
    ax.set_title(f"Loss vs length ({what})", fontsize=10)
    _save(fig, out_dir / "loss_vs_length.png", paths)

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rs in groups.items():
        pp = rs[0]["loss_by_position"]
        longest = max(int(t) for t in rs[0]["loss"])
        # each bucket's centre, not its left edge
        xs = list((np.arange(len(pp)) + 0.5) * longest / len(pp) / rs[0]["train_len"])
        _band(ax, xs, [r["loss_by_position"] for r in rs], label, marker=None)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="position / training length", ylabel="loss")
    ax.set_title("Loss by position in the longest window", fontsize=10)
    _save(fig, out_dir / "loss_by_position.png", paths)

    diag = {
        k: rs
        for k, rs in groups.items()
        if all("diagnostics" in r and normalised(r) for r in rs)
        and all(
            d.get("entropy_beyond") is not None for d in list(rs[0]["diagnostics"].values())[1:]
        )
    }
    if diag:
        # beyond 1x only the rows past the training length: a mean over every row would be
        # dominated by the early rows, which every length shares
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for label, rs in diag.items():
            lengths = list(rs[0]["diagnostics"])
            xs = [int(t) / rs[0]["train_len"] for t in lengths]
            for ax, key in zip(axes, ("entropy", "sink")):
                vals = [
                    [float(np.mean(_beyond(r["diagnostics"][t], key))) for t in lengths] for r in rs
                ]
                _band(ax, xs, vals, label)
        r0 = next(iter(diag.values()))[0]
        first = r0["diagnostics"]
        xs = [int(t) / r0["train_len"] for t in first]
        for ax, key, what in zip(axes, ("entropy", "sink"), ("entropy (nats)", "mass on token 0")):
            uniform = [_beyond(d, f"uniform_{key}") for d in first.values()]
            ax.plot(xs, uniform, color="black", ls=(0, (4, 2)), lw=1, label="uniform attention")
            ax.set(xscale="log", xlabel="length / training length", ylabel=f"mean row {what}")
            ax.set_xticks(xs, [f"{x:g}x" for x in xs])
        axes[1].set_yscale("log")
        fig.suptitle(
            "Rows beyond the training length (at 1x: every row); sigmoid and relu left off",
            fontsize=10,
        )
        _save(fig, out_dir / "entropy_sink_vs_length.png", paths, legend_ax=axes[0])

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for label, rs in diag.items():
            longest = list(rs[0]["diagnostics"])[-1]
            d0 = rs[0]["diagnostics"][longest]
            centres = [(a + b) / 2 / rs[0]["train_len"] for a, b in d0["row_bins"]]
            for ax, key in zip(axes, ("entropy", "sink")):
                vals = [r["diagnostics"][longest][f"{key}_by_row"] for r in rs]
                _band(ax, centres, vals, label, marker=None)
        d0 = r0["diagnostics"][list(r0["diagnostics"])[-1]]
        centres = [(a + b) / 2 / r0["train_len"] for a, b in d0["row_bins"]]
        for ax, key, what in zip(axes, ("entropy", "sink"), ("entropy (nats)", "mass on token 0")):
            ax.plot(centres, d0[f"uniform_{key}_by_row"], color="black", ls=(0, (4, 2)), lw=1,
                    label="uniform attention")  # fmt: skip
            ax.axvline(1.0, color="grey", lw=0.8, ls="--")
            ax.set(xlabel="row position / training length", ylabel=f"row {what}")
        axes[1].set_yscale("log")
        fig.suptitle("By row position in the longest window (bin centres)", fontsize=10)
        _save(fig, out_dir / "entropy_sink_by_row.png", paths, legend_ax=axes[0])

    pk = {k: rs for k, rs in groups.items() if all("passkey" in r for r in rs)}
    if pk:
        ncol = min(4, len(pk))
        nrow = -(-len(pk) // ncol)
        fig, axes = plt.subplots(
            nrow, ncol, figsize=(2.8 * ncol, 2.5 * nrow), squeeze=False, sharey=True
        )
        for ax in axes.flat[len(pk) :]:
            ax.axis("off")
        for ax, (label, rs) in zip(axes.flat, pk.items()):
            acc = [r["passkey"]["accuracy"] for r in rs]
            rows, depths = list(acc[0]), list(acc[0][next(iter(acc[0]))])
            grid = np.array([[np.mean([a[t][d] for a in acc]) for d in depths] for t in rows])
            ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                ink = "white" if v < 0.6 else "black"
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=7, color=ink)
            ax.set_xticks(range(len(depths)), depths)
            ax.set_yticks(range(len(rows)), [f"{int(t) // rs[0]['train_len']}x" for t in rows])
            # learned: the test probes at 1x reach the target, as the report counts it
            first = rows[0]
            learned = sum(
                np.mean(list(a[first].values()))
                >= ((r.get("settings") or {}).get("passkey") or {}).get("target", 0.9)
                for a, r in zip(acc, rs)
            )
            ax.set_title(f"{label}\n(learned at 1x: {learned}/{len(rs)} seeds)", fontsize=8)
            ax.set_xlabel("depth", fontsize=8)
        fig.suptitle("Passkey accuracy (mean over seeds): length x depth", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "passkey.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(out_dir / "passkey.png")
    return paths
