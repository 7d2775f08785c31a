"""The verdicts of ``lssar orbits``, from the runs' numbers and :mod:`lssar.studies.stats` only.

The measure of a run is its **largest exponent error** ``max(|α-1|, |β-1|, |γ+2|)`` of the power
law fitted to the predicted forces (:func:`.ceiling.exponent_errors`), and the yardstick is the
run's noise ceiling (:mod:`.ceiling`): the same error of the exact law seen through that run's
probe noise, on the same points. Every comparison is paired by seed (Student's t over seeds):

- an arm against its ceiling (:func:`versus_ceiling`): *as close as its ceiling* only from an
  equivalence test (TOST, the stated ``margin``), *further* / *closer* when the 95% interval of
  the difference excludes 0, else *not separable from its ceiling at this power*;
- two arms (:func:`compare`): *A is closer to Newton than B* only when the interval of the
  difference excludes 0, else *not separable at this power*, always with the interval;
- the paper's claim (:func:`claim`): LSSAR recovers Newton's form (as close as its ceiling) and
  softmax does not (further than its ceiling); its three declared tests (LSSAR vs ceiling,
  softmax vs ceiling, LSSAR vs softmax) are corrected together by Holm's procedure.

Every sentence here is built from a label, so no sentence says more than its interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from lssar.studies.orbits.ceiling import ERRORS
from lssar.studies.stats import Interval, holm, judge, mean_ci, paired_ci, tost

Result = dict[str, Any]
NAMES = {"lssar": "LSSAR", "softmax": "softmax"}
CLAIM_TESTS = ("lssar vs its ceiling", "softmax vs its ceiling", "lssar vs softmax")


def num(x: float, signed: bool = False) -> str:
    """Three decimals, or three significant digits below 0.01 (a tiny difference that is
    beyond noise must not print as 0.000)."""
    f = ("+" if signed else "") + (".3f" if x == 0 or abs(x) >= 0.01 else ".2e")
    return format(x, f)


def fmt_iv(iv: Interval, signed: bool = False, fixed: bool = False) -> str:
    """``mean [lo, hi]`` (just the mean for one seed); ``fixed``: always three decimals (table
    columns), else :func:`num`."""
    f = (lambda x, sg=False: format(x, "+.3f" if sg else ".3f")) if fixed else num
    m = f(iv.mean, signed)
    return m if iv.lo is None else f"{m} [{f(iv.lo)}, {f(iv.hi)}]"


def _diff(iv: Interval) -> str:
    if iv.lo is None:
        return f"{num(iv.mean, True)} (one seed, no interval)"
    return (
        f"{num(iv.mean, True)} ± {num(iv.half)} (95% t interval over {iv.n} seeds, paired by "
        f"seed; p = {iv.p:.2g})"
    )


def by_seed(results: Sequence[Result]) -> dict[str, dict[int, Result]]:
    """arm -> seed -> result, arms in first-seen order."""
    out: dict[str, dict[int, Result]] = {}
    for r in results:
        out.setdefault(r["arm"], {})[r["seed"]] = r
    return out


def paired_values(
    runs: dict[int, Result],
    other: dict[int, Result] | None,
    fa: Callable[[Result], float],
    fb: Callable[[Result], float],
) -> tuple[list[float], list[float]]:
    """``fa(run)`` and ``fb(run of other)`` (``other`` None: of the same run) on the seeds both
    have, in seed order."""
    seeds = sorted(set(runs) & set(other if other is not None else runs))
    b = other if other is not None else runs
    return [fa(runs[s]) for s in seeds], [fb(b[s]) for s in seeds]


def max_err(r: Result) -> float:
    return float(r["sr"]["errors"]["max_err"])


def ceiling_err(r: Result) -> float:
    return float(r["ceiling"]["max_err"])


def versus_ceiling(
    err: Sequence[float], ceil: Sequence[float], margin: float, reject: bool | None = None
) -> dict[str, Any]:
    """An arm's largest exponent errors ``err`` against its ceiling's ``ceil`` (per seed,
    paired). ``label``: ``"as close as its ceiling"`` (TOST: the 90% interval of the difference
    inside ``±margin``), ``"further than its ceiling"`` / ``"closer than its ceiling"`` (the 95%
    interval excludes 0 and, when given, the multiplicity-corrected test ``reject``\\s),
    ``"not separable from its ceiling"``, or ``"no interval"`` (one seed). Also ``diff``
    (the paired interval), ``tost`` and ``text``."""
    d = paired_ci(err, ceil)
    eq = tost(err, ceil, margin=margin)
    if d.lo is None:
        label = "no interval"
    elif eq.equivalent:
        label = "as close as its ceiling"
    else:
        side = judge(d, lo=0.0)  # "supported": the arm's error is larger, beyond noise
        if side != "within noise" and reject is not False:
            label = "further than its ceiling" if side == "supported" else "closer than its ceiling"
        else:
            label = "not separable from its ceiling"
    text = f"arm − ceiling = {_diff(d)}"
    if d.lo is not None:
        text = f"{label}: {text}"
        text += (
            f"; equivalence within ±{margin:g}: 90% interval [{num(eq.lo)}, {num(eq.hi)}], "
            f"TOST p = {eq.p:.2g}"
        )
        if reject is not None:
            text += f"; Holm-corrected test {'rejects' if reject else 'does not reject'} 0"
    return {
        "label": label,
        "diff": dataclasses.asdict(d),
        "tost": dataclasses.asdict(eq),
        "margin": margin,
        "text": text,
    }


def compare(
    a: Sequence[float], b: Sequence[float], names: tuple[str, str], reject: bool | None = None
) -> dict[str, Any]:
    """Largest exponent errors of arm ``names[0]`` (``a``) vs ``names[1]`` (``b``), paired by
    seed. ``label``: ``"<name> closer"`` (the arm with the lower error) when the 95% interval
    of ``a - b`` excludes 0 (and the corrected test ``reject``\\s, when given), ``"not
    separable"``, ``"no interval"``; ``text`` states it with the interval."""
    d = paired_ci(a, b)
    na, nb = names
    if d.lo is None:
        label, head = "no interval", f"{na} vs {nb} (one seed: no difference is claimed)"
    else:
        side = judge(d, hi=0.0)  # "supported": a's error is lower, beyond noise
        if side != "within noise" and reject is not False:
            win, lose = (na, nb) if side == "supported" else (nb, na)
            label = f"{win} closer"
            head = f"{win} is closer to Newton than {lose}"
        else:
            label, head = "not separable", f"{na} and {nb} are not separable at this power"
    text = f"{head}: largest exponent error {na} − {nb} = {_diff(d)}"
    if reject is not None and d.lo is not None:
        text += f"; Holm-corrected test {'rejects' if reject else 'does not reject'} 0"
    return {"label": label, "diff": dataclasses.asdict(d), "text": text}


def arm_intervals(runs: dict[int, Result]) -> dict[str, Any]:
    """An arm's intervals over seeds: each exponent error of its power law, its ceiling's largest
    error (the mean over the ceiling's draws), both R², and how many runs lie within their
    ceiling's 95th percentile. ``None`` entries for an arm without a ceiling (the oracle)."""
    rs = [runs[s] for s in sorted(runs)]
    out: dict[str, Any] = {k: mean_ci([r["sr"]["errors"][k] for r in rs]) for k in ERRORS}
    out["r2"] = mean_ci([r["sr"]["power_law"]["r2"] for r in rs])
    has = all(r.get("ceiling") for r in rs)
    out["ceiling_max_err"] = mean_ci([ceiling_err(r) for r in rs]) if has else None
    out["ceiling_r2"] = mean_ci([r["ceiling"]["r2"] for r in rs]) if has else None
    out["within"] = sum(bool(r["within_ceiling"]) for r in rs) if has else None
    out["n"] = len(rs)
    return out


def claim(results: Sequence[Result], margin: float) -> dict[str, Any]:
    """The paper's claim: LSSAR's exponents are as close to Newton as its noise ceiling's and
    softmax's are further than its ceiling's. ``status``: ``"supported"`` (both parts),
    ``"contradicted"`` (either part reversed beyond noise), ``"within noise"``, ``"no interval"``
    (one seed), ``"not assessed"`` (an arm missing); ``text`` (Markdown), ``parts``, ``tests``
    (the declared family with p-values and Holm's decisions)."""
    arms = by_seed(results)
    if "lssar" not in arms or "softmax" not in arms:
        return {
            "status": "not assessed",
            "text": "The claim cannot be assessed: it needs both the softmax and the lssar arm.",
        }
    lc = paired_values(arms["lssar"], None, max_err, ceiling_err)
    sc = paired_values(arms["softmax"], None, max_err, ceiling_err)
    ls = paired_values(arms["lssar"], arms["softmax"], max_err, max_err)
    ps = [paired_ci(*lc).p, paired_ci(*sc).p, paired_ci(*ls).p]
    rej = holm(ps)
    lssar = versus_ceiling(*lc, margin, rej[0])
    soft = versus_ceiling(*sc, margin, rej[1])
    graded = compare(*ls, ("LSSAR", "softmax"), rej[2])
    recovers = {
        "as close as its ceiling": "supported",
        "closer than its ceiling": "supported",
        "further than its ceiling": "contradicted",
    }
    fails = {
        "further than its ceiling": "supported",
        "as close as its ceiling": "contradicted",
        "closer than its ceiling": "contradicted",
    }
    parts = {
        "lssar recovers Newton's form": recovers.get(lssar["label"], "within noise"),
        "softmax does not": fails.get(soft["label"], "within noise"),
    }
    n = len(lc[0])
    if n < 2:
        status = "no interval"
        head = (
            f"**Not judged**: {n} seed gives no interval over seeds, so no verdict; the numbers "
            "below describe this run only (run ≥ 3 seeds)."
        )
    elif "contradicted" in parts.values():
        status = "contradicted"
        why = []
        if parts["lssar recovers Newton's form"] == "contradicted":
            why.append("LSSAR's exponents are further from Newton's than its noise ceiling's")
        if parts["softmax does not"] == "contradicted":
            rel = (
                "as close to Newton's as"
                if "as close" in soft["label"]
                else "closer to Newton's than"
            )
            why.append(f"softmax's exponents are {rel} its noise ceiling's")
        head = f"**Contradicted at this scale**: {'; and '.join(why)}."
    elif all(v == "supported" for v in parts.values()):
        status = "supported"
        head = (
            "**Supported at this scale**: LSSAR's exponents are as close to Newton's as its "
            "noise ceiling's, and softmax's are further from Newton's than its ceiling's."
        )
    else:
        status = "within noise"
        head = (
            "**Not separable at this power**: the intervals over seeds settle neither part of "
            "the claim beyond noise."
        )
    text = "\n".join(
        [
            head,
            "",
            f"- LSSAR against its noise ceiling: {lssar['text']}.",
            f"- softmax against its noise ceiling: {soft['text']}.",
            f"- {graded['text']}.",
        ]
    )
    tests = [
        {"test": t, "p": p, "holm_rejects": r} for t, p, r in zip(CLAIM_TESTS, ps, rej, strict=True)
    ]
    return {
        "status": status,
        "text": text,
        "parts": parts,
        "lssar": lssar,
        "softmax": soft,
        "lssar_vs_softmax": graded,
        "tests": tests,
        "margin": margin,
        "n_seeds": n,
    }


def exploratory(results: Sequence[Result], margin: float) -> dict[str, Any]:
    """Every model arm against its ceiling and against softmax and lssar (paired by seed,
    uncorrected 95% intervals: exploratory, not part of the declared claim)."""
    arms = by_seed(results)
    out: dict[str, Any] = {}
    for arm, runs in arms.items():
        if not all(r.get("ceiling") for r in runs.values()):
            continue
        row: dict[str, Any] = {
            "ceiling": versus_ceiling(*paired_values(runs, None, max_err, ceiling_err), margin)
        }
        for ref in ("softmax", "lssar"):
            if ref in arms and ref != arm:
                a, b = paired_values(runs, arms[ref], max_err, max_err)
                row[ref] = compare(a, b, (arm, ref))
        out[arm] = row
    return out
