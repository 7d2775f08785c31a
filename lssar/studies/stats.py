"""Small-sample statistics for reports: t-based 95% intervals over seeds and plain verdicts.

No scipy: the two-sided 95% Student-t quantiles are a table (df 1..30, then the normal 1.96).
A verdict compares two arms by their intervals, never by point estimates:

- ``"inconclusive"``: either arm is below ``floor`` (90%) accuracy at the training length, so
  its extrapolation cannot be read (it never learned the task);
- ``"no interval"``: fewer than two seeds on a side, so no interval exists and nothing is
  ``"supported"``;
- ``"supported"``: the two 95% intervals do not overlap (``better`` says which side is higher);
- ``"within noise"``: they overlap.

For losses, :func:`paired_ci` gives the interval of a difference paired by seed and
:func:`judge` reads a claim "the value lies in (lo, hi)" from an interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# two-sided 95% quantiles of Student's t, df = 1..30
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t95(df: int) -> float:
    """Two-sided 95% Student-t quantile for ``df`` degrees of freedom (1.96 beyond 30)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    return T95[df - 1] if df <= len(T95) else 1.96


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float | None  # None when there is a single value (no interval)
    hi: float | None
    n: int

    @property
    def half(self) -> float | None:
        return None if self.lo is None else (self.hi - self.mean)

    def fmt(self, pct: bool = True) -> str:
        f = (lambda x: f"{100 * x:.1f}") if pct else (lambda x: f"{x:.3g}")
        return f(self.mean) if self.lo is None else f"{f(self.mean)} ± {f(self.half)}"


def mean_ci(values: Sequence[float]) -> Interval:
    """Mean and t-based 95% interval of ``values`` (one per seed)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("values: need at least one value")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, None, None, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    h = t95(n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - h, mean + h, n)


@dataclass(frozen=True)
class Verdict:
    label: str  # "supported" | "within noise" | "inconclusive" | "no interval"
    better: str | None  # "a" | "b" | None
    detail: str


def verdict(
    a: Sequence[float],
    b: Sequence[float],
    a_at_1x: Sequence[float] | None = None,
    b_at_1x: Sequence[float] | None = None,
    floor: float = 0.9,
    names: tuple[str, str] = ("a", "b"),
) -> Verdict:
    """Compare per-seed accuracies ``a`` vs ``b`` (same cell); see the module docstring."""
    ia, ib = mean_ci(a), mean_ci(b)
    for side, base in ((names[0], a_at_1x), (names[1], b_at_1x)):
        if base is not None and mean_ci(base).mean < floor:
            return Verdict(
                "inconclusive",
                None,
                f"{side} is at {100 * mean_ci(base).mean:.1f}% at 1x (< {100 * floor:.0f}%): "
                "it did not learn the task, so its extrapolation cannot be read",
            )
    hi_side = "a" if ia.mean >= ib.mean else "b"
    lead = names[0] if hi_side == "a" else names[1]
    if ia.lo is None or ib.lo is None:
        return Verdict(
            "no interval",
            None,
            f"{names[0]} {ia.fmt()}% vs {names[1]} {ib.fmt()}%: one seed, no interval, "
            "so no difference is supported",
        )
    if ia.lo > ib.hi or ib.lo > ia.hi:
        return Verdict(
            "supported",
            hi_side,
            f"{lead} higher: {names[0]} {ia.fmt()}% vs {names[1]} {ib.fmt()}% (intervals separate)",
        )
    return Verdict(
        "within noise",
        None,
        f"{names[0]} {ia.fmt()}% vs {names[1]} {ib.fmt()}% (95% intervals overlap)",
    )


def paired_ci(a: Sequence[float], b: Sequence[float]) -> Interval:
    """The t-based 95% interval of ``a - b`` paired by seed (``a[i]`` and ``b[i]`` share seed
    ``i``: the same data order and initialisation), tighter than two separate intervals when
    seeds move both arms together."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same seeds on both sides: {len(a)} vs {len(b)}")
    return mean_ci([x - y for x, y in zip(a, b)])


def judge(iv: Interval, lo: float = -math.inf, hi: float = math.inf) -> str:
    """Whether the claim "the value lies in ``(lo, hi)``" holds, from its 95% interval ``iv``:
    ``"supported"`` when the whole interval lies strictly inside, ``"contradicted"`` when it lies
    wholly outside, ``"within noise"`` when it touches or straddles a bound, ``"no interval"``
    with one seed. ``judge(diff, hi=0)`` reads "a - b < 0": a is lower, beyond noise."""
    if lo > hi:
        raise ValueError(f"empty claim range ({lo}, {hi})")
    if iv.lo is None:
        return "no interval"
    if lo < iv.lo and iv.hi < hi:
        return "supported"
    if iv.hi < lo or iv.lo > hi:
        return "contradicted"
    return "within noise"
