"""Small-sample statistics shared by every study: one set of rules for every verdict.

Every arm of a study is trained with the same seeds, and seed ``i`` of two arms shares the data
order and the initialisation, so every comparison is **paired by seed**: the interval of the
per-seed differences ``a[i] - b[i]`` (Student's t, two-sided 95%), for losses and accuracies
alike. From that interval:

- :func:`judge` reads a claim "the value lies in ``(lo, hi)``": *supported* when the whole
  interval lies inside, *contradicted* when it lies wholly outside, else *within noise* (not
  separable at this power), *no interval* with one seed;
- :func:`verdict` compares two arms' accuracies, and is *inconclusive* when either arm is
  below ``floor`` at the training length (it never learned the task, so its extrapolation
  cannot be read);
- :func:`holm` corrects a family of declared claims for multiplicity (Holm's step-down
  procedure on the paired t-tests' p-values, :func:`t_test`);
- :func:`tost` is the only way to say two arms *match*: the two one-sided tests against a stated
  margin (equivalently, the 90% interval inside ``(-margin, margin)``);
- :class:`Claim` and :func:`judge_claims` apply all of it to a study's declared list: each claim
  judged from its interval (or TOST), then Holm over the list, saying which verdicts change.

The Student-t distribution is computed here (:func:`t_cdf`, :func:`t_ppf`, from the
regularised incomplete beta function) so the library needs no scipy; the tests check every
function against scipy on fixed inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# --------------------------------------------------------------------- Student's t


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300

    def step(num: float, c: float, d: float) -> tuple[float, float, float]:
        d = 1.0 + num * d
        c = 1.0 + num / c
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = c if abs(c) > tiny else tiny
        return c, d, c * d

    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        even = m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0))
        c, d, f = step(even, c, d)
        h *= f
        c, d, f = step(odd, c, d)
        h *= f
        if abs(f - 1.0) < 3e-16:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
    ln += b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df} must be > 0")
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + x * x))
    return 1.0 - tail if x > 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (bisection on
    :func:`t_cdf`, to ~1e-12)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q} must be in (0, 1)")
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def t95(df: int) -> float:
    """Two-sided 95% Student-t quantile for ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    return t_ppf(0.975, df)


# ------------------------------------------------------------------------ intervals


@dataclass(frozen=True)
class Interval:
    """A mean with its t interval over ``n`` values (seeds); ``lo``/``hi`` are None for one
    value. ``p`` is the two-sided t-test p-value of "the mean is 0" (None for one value)."""

    mean: float
    lo: float | None
    hi: float | None
    n: int
    p: float | None = None

    @property
    def half(self) -> float | None:
        return None if self.lo is None else (self.hi - self.mean)

    def fmt(self, pct: bool = True) -> str:
        f = (lambda x: f"{100 * x:.1f}") if pct else (lambda x: f"{x:.3g}")
        return f(self.mean) if self.lo is None else f"{f(self.mean)} ± {f(self.half)}"


def mean_ci(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean, two-sided t interval at ``level`` and the t-test p-value of ``values`` (one per
    seed)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("values: need at least one value")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, None, None, 1)
    se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)
    h = t_ppf(0.5 + level / 2.0, n - 1) * se
    if se == 0.0:
        p = 1.0 if mean == 0.0 else 0.0
    else:
        p = 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    return Interval(mean, mean - h, mean + h, n, p)


def paired_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """The t interval of ``a - b`` paired by seed (``a[i]`` and ``b[i]`` share seed ``i``: the
    same data order and initialisation), tighter than two separate intervals when seeds move
    both arms together; ``p`` is the paired t-test's two-sided p-value."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same seeds on both sides: {len(a)} vs {len(b)}")
    return mean_ci([x - y for x, y in zip(a, b)], level)


def t_test(a: Sequence[float], b: Sequence[float] | None = None) -> float | None:
    """The two-sided p-value of the paired t-test of ``a`` vs ``b`` (of "mean(a) = 0" without
    ``b``); None with one seed."""
    return (mean_ci(a) if b is None else paired_ci(a, b)).p


# ------------------------------------------------------------------------- verdicts


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
    """Compare per-seed accuracies ``a`` vs ``b`` (same cell, the same seeds in the same
    order), paired by seed: *supported* when the 95% interval of ``a - b`` excludes 0 (``better``
    says which side is higher), else *within noise*; *inconclusive* when an arm is below
    ``floor`` at 1x; *no interval* with one seed."""
    for side, base in ((names[0], a_at_1x), (names[1], b_at_1x)):
        if base is not None and mean_ci(base).mean < floor:
            return Verdict(
                "inconclusive",
                None,
                f"{side} is at {100 * mean_ci(base).mean:.1f}% at 1x (< {100 * floor:.0f}%): "
                "it did not learn the task, so its extrapolation cannot be read",
            )
    ia, ib, d = mean_ci(a), mean_ci(b), paired_ci(a, b)
    both = f"{names[0]} {ia.fmt()}% vs {names[1]} {ib.fmt()}%"
    if d.lo is None:
        return Verdict(
            "no interval", None, f"{both}: one seed, no interval, so no difference is supported"
        )
    diff = f"{names[0]} - {names[1]} = {100 * d.mean:+.1f} ± {100 * d.half:.1f} points"
    if judge(d, hi=0.0) == "within noise":
        return Verdict("within noise", None, f"{both}; {diff} (paired by seed; includes 0)")
    hi_side = "a" if d.mean > 0 else "b"
    lead = names[0] if hi_side == "a" else names[1]
    return Verdict("supported", hi_side, f"{lead} higher: {both}; {diff} (paired by seed)")


def holm(pvalues: Sequence[float | None], alpha: float = 0.05) -> list[bool | None]:
    """Holm's step-down correction over a family of tests: which nulls are rejected at
    family-wise error ``alpha``. A ``None`` p-value (one seed) is not tested and gets None;
    the family is the tests that have a p-value."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    out: list[bool | None] = [None] * len(pvalues)
    m, rejecting = len(tested), True
    for k, (p, i) in enumerate(tested):
        rejecting = rejecting and p <= alpha / (m - k)
        out[i] = rejecting
    return out


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests of ``|mean| < margin``: ``equivalent`` when both reject at
    ``alpha`` (the ``1 - 2 alpha`` interval ``lo``..``hi`` lies inside ``(-margin, margin)``);
    ``p`` is the larger of the two one-sided p-values (None with one seed)."""

    mean: float
    lo: float | None
    hi: float | None
    margin: float
    p: float | None
    equivalent: bool


def tost(
    a: Sequence[float],
    b: Sequence[float] | None = None,
    margin: float = 0.02,
    alpha: float = 0.05,
) -> Equivalence:
    """Paired TOST of ``a - b`` (or of ``a`` without ``b``) against ``(-margin, margin)``."""
    if margin <= 0:
        raise ValueError(f"margin={margin} must be > 0")
    xs = [float(x) for x in a] if b is None else [x - y for x, y in zip(a, b, strict=True)]
    iv = mean_ci(xs, level=1.0 - 2.0 * alpha)
    if iv.lo is None:
        return Equivalence(iv.mean, None, None, margin, None, False)
    se = (iv.hi - iv.mean) / t_ppf(1.0 - alpha, iv.n - 1)
    if se == 0.0:
        p = 0.0 if abs(iv.mean) < margin else 1.0
    else:
        p_low = 1.0 - t_cdf((iv.mean + margin) / se, iv.n - 1)  # H0: mean <= -margin
        p_high = t_cdf((iv.mean - margin) / se, iv.n - 1)  # H0: mean >= margin
        p = max(p_low, p_high)
    return Equivalence(iv.mean, iv.lo, iv.hi, margin, p, p < alpha)


# ------------------------------------------------------------------ declared claims

NOT_SEPARABLE = "not separable at this power"


@dataclass(frozen=True)
class Claim:
    """One declared claim of the paper, on per-seed values (a ratio, or a difference paired by
    seed): ``lo``/``hi`` bound a directional claim ("the value lies in (lo, hi)"); ``margin``
    makes it an equivalence claim ("|value| < margin", judged by TOST)."""

    text: str
    values: list[float]
    criterion: str
    digits: int = 3
    lo: float = -math.inf
    hi: float = math.inf
    margin: float | None = None

    def __post_init__(self) -> None:
        # one criterion per claim, so its test (and its p-value for Holm) is unambiguous
        given = [math.isfinite(self.lo), math.isfinite(self.hi), self.margin is not None]
        if sum(given) != 1:
            raise ValueError(f"claim {self.text!r}: give exactly one of lo, hi or margin")

    def raw(self) -> tuple[str, float | None]:
        """(verdict before the multiplicity correction, the p-value of its deciding test).

        Directional: :func:`judge` of the 95% interval; p of the t-test of the value against the
        bound. Equivalence: *supported* when TOST rejects both one-sided nulls, *contradicted*
        when the 95% interval lies wholly outside the margin (p: the t-test against the nearer
        bound), else *not separable at this power* (p: TOST's)."""
        iv = mean_ci(self.values)
        if iv.lo is None:
            return "no interval", None
        if self.margin is not None:
            eq = tost(self.values, margin=self.margin)
            bound = self.margin if iv.mean > 0 else -self.margin
            if judge(iv, lo=-self.margin, hi=self.margin) == "contradicted":
                return "contradicted", mean_ci([v - bound for v in self.values]).p
            return ("supported" if eq.equivalent else NOT_SEPARABLE), eq.p
        bound = self.hi if math.isfinite(self.hi) else self.lo
        return judge(iv, lo=self.lo, hi=self.hi), mean_ci([v - bound for v in self.values]).p


def judge_claims(claims: list[Claim], alpha: float = 0.05) -> list[tuple[str, str, str]]:
    """Per claim: (raw verdict, verdict after Holm's correction over the whole declared list,
    a note with the p-value and whether Holm changed the verdict). A raw *supported* or
    *contradicted* whose test Holm does not reject becomes *within noise* (*not separable at
    this power* for an equivalence claim)."""
    raws = [c.raw() for c in claims]
    rejected = holm([p for _, p in raws], alpha)
    m = sum(p is not None for _, p in raws)
    out = []
    for c, (raw, p), rej in zip(claims, raws, rejected):
        if p is None:
            out.append((raw, raw, "one seed: no test"))
            continue
        final = raw
        if raw in ("supported", "contradicted") and not rej:
            final = NOT_SEPARABLE if c.margin is not None else "within noise"
        change = "unchanged by Holm" if final == raw else f"**Holm changes it** (raw: {raw})"
        shown = "p < 0.0001" if p < 1e-4 else f"p = {p:.2g}"
        out.append((raw, final, f"{shown}; {change} over the {m} declared claims"))
    return out
