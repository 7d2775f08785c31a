"""Figures of an evaluation (``lssar eval``) and of ``lssar reproduce``'s report.

Results are grouped by arm (:func:`lssar.studies.labels.group`: one group holds that arm's
seeds). Every figure
draws an arm in its colour and line style from :mod:`lssar.studies.style` (the same in every
study), the mean over seeds with a 95% t-band over seeds (:func:`lssar.studies.stats.mean_ci`;
one seed: no band, and the title says which). A figure with more arms than one panel reads at a
glance is split into panels by family (:func:`lssar.studies.style.facets`: at most six lines,
softmax and LSSAR p=15 drawn thin beside each family for reference), on one y-scale except the
pointwise rules' (sigmoid, relu), whose loss explodes; each panel's legend sits under it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lssar.ops import VARIANTS
from lssar.studies.labels import group
from lssar.studies.stats import mean_ci
from lssar.studies.style import facets, grid, legend_below, spread, style

Result = dict[str, Any]
# one seed's values at a figure's x positions: (xs, [seed][point])
Series = Callable[[list[Result]], tuple[list[float], list[list[float]]]]


def normalised(r: Result) -> bool:
    """Whether the evaluated rule's rows sum to 1 (every l1 variant): entropy and first-token
    mass compare across arms only then, so the unnormalised ones (sigmoid, relu) are left off
    those axes."""
    v = VARIANTS.get(str(r["evaluated_attention"]).split(" ")[0])
    return v is None or v.l1


def _band(ax, xs, per_seed: list[list[float]], label: str, marker: str | None, ref: bool) -> None:
    """Mean over seeds (``per_seed[i][k]``: seed i at point k) and its 95% band; a reference
    arm (another family's, drawn for comparison) thin and faint."""
    ivs = [mean_ci([s[k] for s in per_seed]) for k in range(len(xs))]
    st = style(label)
    means = [iv.mean for iv in ivs]
    if ref:
        ax.plot(xs, means, lw=1, alpha=0.7, label=f"{label} (ref.)", **st)
    else:
        ax.plot(xs, means, marker=marker, ms=4, label=label, **st)
    if ivs[0].lo is not None:
        lo, hi = [iv.lo for iv in ivs], [iv.hi for iv in ivs]
        ax.fill_between(xs, lo, hi, color=st["color"], alpha=0.06 if ref else 0.15, lw=0)


def _beyond(d: dict[str, Any], key: str) -> Any:
    """A diagnostic over the rows beyond the training length, or over every row at 1x (where
    none is beyond)."""
    far = d.get(f"{key}_beyond")
    return d[key] if far is None else far


def _one_scale(axes) -> None:
    """One y-range over ``axes``: the union of their own."""
    if axes:
        lims = [ax.get_ylim() for ax in axes]
        lo, hi = min(a for a, _ in lims), max(b for _, b in lims)
        for ax in axes:
            ax.set_ylim(lo, hi)


def _faceted(
    plt,
    groups: dict[str, list[Result]],
    rows: list[tuple[str, Series]],
    decorate: Callable[[Any, int], None],
    marker: str | None,
):
    """A figure of the arms in ``groups``: one panel per facet (:func:`facets`), and per facet
    one row of panels per quantity in ``rows`` ((y label, series)); a quantity shares one
    y-scale over its panels (the pointwise rules' own). ``decorate(ax, row)`` adds what every
    panel of a row has (axes scales, reference curves)."""
    panels = facets(groups)
    if len(rows) == 1:
        nrow, ncol = grid(len(panels))
        at = [divmod(i, ncol) for i in range(len(panels))]
    else:
        nrow, ncol = len(rows), len(panels)
        at = [(0, i) for i in range(len(panels))]
    many = len(panels) > 1  # a legend under each panel, else one beside the only one
    fig, axes = plt.subplots(
        nrow,
        ncol,
        figsize=(4.4 * ncol + 2.8 * (not many), (3.1 + 1.1 * many) * nrow),
        squeeze=False,
        layout="constrained",
    )
    for ax in axes.flat[len(panels) :] if len(rows) == 1 else []:
        ax.axis("off")
    for q, (ylabel, series) in enumerate(rows):
        shared = []
        for (r, c), facet in zip(at, panels):
            ax = axes[r + q, c]
            for label in facet.lines:
                xs, vals = series(groups[label])
                _band(ax, xs, vals, label, marker, ref=label in facet.refs)
            decorate(ax, q)
            ax.set_ylabel(ylabel)
            if q == 0 and facet.title:
                ax.set_title(facet.title, fontsize=9)
            if not facet.own_scale:
                shared.append(ax)
            if many and (len(rows) == 1 or q == len(rows) - 1):
                legend_below(ax)
        _one_scale(shared)
    if not many:
        fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside right center", fontsize=8)
    return fig


def _save(plt, fig, path: Path, paths: list[Path]) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    paths.append(path)


def _log_lengths(xs: list[float], xlabel: str) -> Callable[[Any, int], None]:
    def decorate(ax, _row: int) -> None:
        ax.set(xscale="log", xlabel=xlabel)
        ax.set_xticks(xs, [f"{x:g}x" for x in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)

    return decorate


def passkey_chance(r: Result) -> float:
    """Chance of guessing the key of ``r``'s passkey probes (its digits, as the probes drew
    them: :attr:`lssar.studies.lm.passkey.PasskeySettings.chance`)."""
    from lssar.studies.lm.passkey import PasskeySettings

    digits = ((r.get("settings") or {}).get("passkey") or {}).get("digits", 5)
    return PasskeySettings(digits=digits).chance


def plot_results(results: list[Result], out_dir: Path) -> list[Path]:
    """Loss vs length, loss by position, entropy/first-token mass vs length and by row (with the
    uniform attention values) and a passkey grid per arm, as PNG files in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    groups, paths = group(results), []
    seeds = spread([len(rs) for rs in groups.values()])
    r0 = results[0]
    L = r0["train_len"]
    lengths = list(r0["loss"])
    xs = [int(t) / L for t in lengths]

    def loss(rs):
        return xs, [[r["loss"][t] for t in lengths] for r in rs]

    fig = _faceted(
        plt,
        groups,
        [("validation loss", loss)],
        _log_lengths(xs, "evaluation length / training length"),
        "o",
    )
    fig.suptitle(f"Loss vs length ({seeds})", fontsize=10)
    _save(plt, fig, out_dir / "loss_vs_length.png", paths)

    def by_position(rs):
        pp = rs[0]["loss_by_position"]
        longest = max(int(t) for t in rs[0]["loss"])
        # each bucket's centre, not its left edge
        return list((np.arange(len(pp)) + 0.5) * longest / len(pp) / L), [
            r["loss_by_position"] for r in rs
        ]

    def at_l(ax, _row: int) -> None:
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("position / training length (bucket centres)")
        ax.grid(alpha=0.3)

    fig = _faceted(plt, groups, [("loss", by_position)], at_l, None)
    fig.suptitle(f"Loss by position in the longest window ({seeds})", fontsize=10)
    _save(plt, fig, out_dir / "loss_by_position.png", paths)

    diag = {
        k: rs
        for k, rs in groups.items()
        if all("diagnostics" in r and normalised(r) for r in rs)
        and all(
            d.get("entropy_beyond") is not None for d in list(rs[0]["diagnostics"].values())[1:]
        )
    }
    if diag:
        _diagnostics(plt, diag, out_dir, paths)

    pk = {k: rs for k, rs in groups.items() if all("passkey" in r for r in rs)}
    if pk:
        _passkey(plt, pk, out_dir, paths)
    return paths


_WHAT = {"entropy": "entropy (nats)", "sink": "mass on token 0"}


def _diagnostics(plt, diag: dict[str, list[Result]], out_dir: Path, paths: list[Path]) -> None:
    """Entropy and first-token mass: vs length over the rows beyond the training length (at 1x
    every row: a mean over every row would be dominated by the early rows, which every length
    shares), and by row position in the longest window; each against uniform attention."""
    seeds = spread([len(rs) for rs in diag.values()])
    r0 = next(iter(diag.values()))[0]
    L, first = r0["train_len"], r0["diagnostics"]
    lengths = list(first)
    xs = [int(t) / L for t in lengths]

    def vs_length(key: str) -> Series:
        return lambda rs: (
            xs,
            [[float(np.mean(_beyond(r["diagnostics"][t], key))) for t in lengths] for r in rs],
        )

    log_x = _log_lengths(xs, "length / training length")

    def uniform_vs_length(ax, row: int) -> None:
        log_x(ax, row)
        key = ("entropy", "sink")[row]
        ys = [_beyond(d, f"uniform_{key}") for d in first.values()]
        ax.plot(xs, ys, color="black", ls=(0, (4, 2)), lw=1, label="uniform attention")
        if key == "sink":
            ax.set_yscale("log")

    rows = [(f"mean row {_WHAT[k]}", vs_length(k)) for k in ("entropy", "sink")]
    fig = _faceted(plt, diag, rows, uniform_vs_length, "o")
    fig.suptitle(
        f"Rows beyond the training length (at 1x: every row; {seeds}); sigmoid and relu left "
        "off (rows do not sum to 1)",
        fontsize=10,
    )
    _save(plt, fig, out_dir / "entropy_sink_vs_length.png", paths)

    longest = lengths[-1]
    d0 = first[longest]
    centres = [(a + b) / 2 / L for a, b in d0["row_bins"]]

    def by_row(key: str) -> Series:
        return lambda rs: (centres, [r["diagnostics"][longest][f"{key}_by_row"] for r in rs])

    def uniform_by_row(ax, row: int) -> None:
        key = ("entropy", "sink")[row]
        ys = d0[f"uniform_{key}_by_row"]
        ax.plot(centres, ys, color="black", ls=(0, (4, 2)), lw=1, label="uniform attention")
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("row position / training length (bin centres)")
        ax.grid(alpha=0.3)
        if key == "sink":
            ax.set_yscale("log")

    rows = [(f"row {_WHAT[k]}", by_row(k)) for k in ("entropy", "sink")]
    fig = _faceted(plt, diag, rows, uniform_by_row, None)
    fig.suptitle(f"By row position in the longest window ({seeds})", fontsize=10)
    _save(plt, fig, out_dir / "entropy_sink_by_row.png", paths)


def _passkey(plt, pk: dict[str, list[Result]], out_dir: Path, paths: list[Path]) -> None:
    """One length x depth grid of accuracy per arm, on one colour scale (its bar marks chance)."""
    nrow, ncol = grid(len(pk), 4)
    fig, axes = plt.subplots(
        nrow,
        ncol,
        figsize=(2.8 * ncol + 1.0, 2.6 * nrow + 0.4),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    for ax in axes.flat[len(pk) :]:
        ax.axis("off")
    chance = passkey_chance(next(iter(pk.values()))[0])
    image = None
    for ax, (label, rs) in zip(axes.flat, pk.items()):
        acc = [r["passkey"]["accuracy"] for r in rs]
        rows, depths = list(acc[0]), list(acc[0][next(iter(acc[0]))])
        grid_ = np.array([[np.mean([a[t][d] for a in acc]) for d in depths] for t in rows])
        image = ax.imshow(grid_, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), v in np.ndenumerate(grid_):
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
    bar = fig.colorbar(image, ax=axes, shrink=0.9, label="accuracy")
    bar.ax.axhline(chance, color="red", lw=2)
    ticks = [t for t in (0.0, 0.25, 0.5, 0.75, 1.0) if abs(t - chance) > 0.08]
    bar.set_ticks(sorted([*ticks, chance]))
    bar.set_ticklabels(
        [f"chance {100 * t:.2g}%" if t == chance else f"{t:.0%}" for t in bar.get_ticks()]
    )
    n = sorted({len(rs) for rs in pk.values()})
    what = "one seed" if n == [1] else f"mean over {'/'.join(map(str, n))} seeds"
    fig.suptitle(f"Passkey accuracy ({what}): length x depth", fontsize=10)
    _save(plt, fig, out_dir / "passkey.png", paths)
