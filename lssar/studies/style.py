"""One colour and line style per arm in every figure of every study (LM, recall, orbits), and
the panels a figure with many arms is split into.

An arm is named by its LM label (:func:`lssar.studies.labels.label_of`: ``"lssar p=15"``,
``"softmax + alibi"``, ``"lssa -> lssar p=15 (eval only)"``);
:func:`lssar.studies.labels.key` maps the other studies' spellings onto it (recall:
``"window"``, ``"... (eval)"``; orbits: ``"lssar"``, ``"lssar-p3"``, ``"softmax-local"``), so
the same arm has the same colour everywhere.

Families have hues and their variants shades: softmax blue with its window control cyan and the
length-scaled softmaxes purple, the Softplus-l1 family orange / green / pink / red, LSSA
re-weighted at evaluation on a viridis ramp by p, ALiBi orange and NoPE grey, the RoPE scalings
browns, the pointwise rules grey and olive. Line styles by family: softmax-normalised solid,
Softplus-l1 / LSSA / LSSAR dashed, pointwise (unnormalised) dash-dot, eval-only rules dotted.
Within any panel :func:`facets` builds, every two lines differ by a CIELAB distance of at least
15 (a test holds this for every preset of every study).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lssar.studies.labels import LSSAR15, SOFTMAX, WINDOW, key

LSSA = "lssa"
POINTWISE = ("sigmoid", "relu")
# the p of LSSA's eval-only re-weighting sweeps (LM: 1, 3, 8, 15; recall: all six)
_REWEIGHT = dict(
    zip(
        (1, 2, 3, 5, 8, 15),
        ("#9bd93c", "#44bf70", "#1e9c89", "#2a788e", "#3b528b", "#482475"),  # viridis .85-.1
    )
)
COLOURS = {
    # softmax, its window control, and softmax with a length scale (the decomposition)
    SOFTMAX: "#1f77b4",
    WINDOW: "#17becf",
    "softmax-qknorm-logn": "#9467bd",
    "softmax-qknorm-const": "#c5b0d5",
    "softmax-qknorm-learned": "#5254a3",
    "softmax-qknorm-logn p=15": "#7b4173",
    "ssmax": "#8c564b",
    # the pointwise rules (rows do not sum to 1)
    "sigmoid": "#7f7f7f",
    "relu": "#bcbd22",
    # Softplus-l1, LSSA and LSSAR
    "softplus-l1": "#ff7f0e",
    "lssa-const": "#98df8a",
    LSSA: "#2ca02c",
    "lssar p=3": "#e377c2",
    LSSAR15: "#d62728",
    "lssar p=15 scale_dim=64": "#ad494a",  # the factorial's ln d arm: near LSSAR's red
    **{f"lssa -> lssar p={p} (eval only)": c for p, c in _REWEIGHT.items()},
    # the practitioner's alternatives: positions trained in, RoPE rescaled at eval
    "softmax + alibi": "#e6550d",
    "softmax + nope": "#636363",
    "lssar p=15 + nope": "#ff9896",
    "softmax -> linear auto (eval only)": "#dfc27d",
    "softmax -> ntk auto (eval only)": "#bf812d",
    "softmax -> dynamic-ntk auto (eval only)": "#8c510a",
    "softmax -> yarn auto (eval only)": "#543005",
    # the orbits study's arms without an LM twin
    "scratch": "#8c6d31",
    "softmax-masses": "#393b79",
    "oracle": "#000000",
}
_SPARE = ["#637939", "#a55194", "#6b6ecf", "#e7969c", "#17a768", "#b5cf6b"]

MAX_LINES = 6  # lines in one panel of a line figure, references included


def colour(label: str) -> str:
    """The arm's colour, the same in every figure of every study (an arm :data:`COLOURS` does
    not know: a stable one of its own)."""
    return COLOURS.get(key(label)) or _SPARE[zlib.crc32(key(label).encode()) % len(_SPARE)]


def linestyle(label: str) -> str:
    """The arm's family's line style: eval-only rules dotted, pointwise dash-dot, Softplus-l1 /
    LSSA / LSSAR dashed, the softmax-normalised rest solid."""
    k = key(label)
    if "(eval only)" in k:
        return ":"
    if k.split(" ")[0] in POINTWISE:
        return "-."
    if k.startswith(("lssa", "softplus")):
        return "--"
    return "-"


def style(label: str) -> dict[str, str]:
    """Matplotlib ``color`` and ``ls`` of an arm."""
    return {"color": colour(label), "ls": linestyle(label)}


@dataclass(frozen=True)
class Family:
    """A panel's worth of arms: its title, the arms drawn beside it for reference (when the
    figure has them) and whether it keeps a y-scale of its own (the pointwise rules, whose loss
    explodes, would squash every other panel's)."""

    title: str
    refs: tuple[str, ...] = (SOFTMAX, LSSAR15)
    own_scale: bool = False


FAMILIES = {
    "softmax": Family("softmax, its window control and length scales"),
    "lssa": Family("Softplus-l1, LSSA and LSSAR"),
    "reweight": Family("LSSA re-weighted at evaluation only", refs=(LSSA, LSSAR15)),
    "positions": Family("ALiBi and NoPE (trained in)"),  # titled by the rules drawn
    "rope": Family("RoPE rescaled at evaluation only"),
    "pointwise": Family("sigmoid and relu: unnormalised, own y-scale", own_scale=True),
}


def family(label: str) -> str:
    """The arm's family, a key of :data:`FAMILIES`."""
    k = key(label)
    if "(eval only)" in k:
        return "reweight" if "-> lssar" in k else "rope"
    if re.search(r" \+ (alibi|nope)$", k):
        return "positions"
    if k.split(" ")[0] in POINTWISE:
        return "pointwise"
    if k.startswith(("lssa", "softplus")):
        return "lssa"
    return "softmax"


def _positions_title(arms: Iterable[str]) -> str:
    """The positions panel's title, naming only the rules it draws: "ALiBi (trained in)"
    without a NoPE arm."""
    names = {"alibi": "ALiBi", "nope": "NoPE"}
    kinds = [n for k, n in names.items() if any(key(a).endswith(f" + {k}") for a in arms)]
    return f"{' and '.join(kinds)} (trained in)"


@dataclass(frozen=True)
class Facet:
    """One panel: its title ("" for the only one), its arms and the reference arms drawn
    beside them (labels as the figure has them)."""

    title: str
    arms: tuple[str, ...]
    refs: tuple[str, ...] = ()
    own_scale: bool = False

    @property
    def lines(self) -> tuple[str, ...]:
        return self.arms + self.refs


def facets(labels: Iterable[str], limit: int = MAX_LINES) -> list[Facet]:
    """The panels of a figure of ``labels``: one, if they fit in ``limit`` lines and none is
    pointwise; else one per family (in :data:`FAMILIES` order, arms in the given order) with its
    references, a family too big for one panel split evenly, and a panel dropped when each of
    its arms is already a reference in another on the shared y-scale. Every panel holds at most
    ``limit`` lines."""
    labels = list(dict.fromkeys(labels))
    groups: dict[str, list[str]] = {name: [] for name in FAMILIES}
    for label in labels:
        groups[family(label)].append(label)
    if len(labels) <= limit and not groups["pointwise"]:
        return [Facet("", tuple(labels))]
    present = {key(label): label for label in labels}
    panels: list[Facet] = []
    for name, arms in groups.items():
        if not arms:
            continue
        fam = FAMILIES[name]
        refs = tuple(present[r] for r in fam.refs if r in present and present[r] not in arms)
        room = limit - len(refs)
        if room < 1:
            raise ValueError(f"limit={limit} leaves no room beside the references {refs}")
        n = math.ceil(len(arms) / room)
        head = _positions_title(arms) if name == "positions" else fam.title
        for i in range(n):
            part = tuple(arms[len(arms) * i // n : len(arms) * (i + 1) // n])
            title = head if n == 1 else f"{head} ({i + 1}/{n})"
            panels.append(Facet(title, part, refs, fam.own_scale))
    for p in list(panels):  # a reference on a panel of its own scale does not count
        shown = {r for q in panels if q is not p and not q.own_scale for r in q.refs}
        if len(panels) > 1 and set(p.arms) <= shown:
            panels.remove(p)
    return panels


def grid(n: int, ncols: int = 3) -> tuple[int, int]:
    """(rows, columns) of ``n`` panels, at most ``ncols`` a row, the rows as even as they
    can be (4 panels: 2 x 2)."""
    rows = math.ceil(n / ncols)
    return rows, math.ceil(n / rows)


def spread(seeds: Sequence[int], mark: str = "band") -> str:
    """What a figure's error marks are, from each arm's number of seeds: ``"mean over 3 seeds,
    95% t-band"``, ``"one seed: no band"``, or both when the arms differ."""
    several = sorted({n for n in seeds if n > 1})
    if not several:
        return f"one seed: no {mark}"
    counts = "/".join(map(str, several))
    one = f"; arms with one seed: no {mark}" if min(seeds) < 2 else ""
    return f"mean over {counts} seeds, 95% t-{mark}{one}"


def legend_below(ax, ncol: int = 2) -> None:
    """The panel's legend under its axes (outside them), small."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.2),
            ncol=ncol,
            fontsize=7,
            frameon=False,
        )
