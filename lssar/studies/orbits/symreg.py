"""Offline symbolic regression of force laws ``(m1, m2, r) -> F`` (positive forces).

* :func:`power_law_fit` -- OLS of ``log F`` on ``[1, log m1, log m2, log r]`` + bootstrap.
* :func:`sparse_law_search` -- best subset (<= 3 terms, BIC) of a log-space term library,
  refitted on random data subsets to see whether they agree on one law.
* :func:`gp_symbolic_regression` -- genetic programming (pyoperon / gplearn / PySR) on the raw
  inputs with ``+ - * /``; candidates are simplified with sympy, their constants refined by
  least squares, and :func:`is_newton` checks the winner against ``C m1 m2 / r**2``.
* :func:`criteria` -- the inverse-square and Newton pass/fail rules.

Inputs are 1-D arrays of shape ``(n,)``; masses, distances and forces must be positive.
Expressions use the positive sympy symbols :data:`M1`, :data:`M2`, :data:`R` (``m1, m2, r``).
"""

from __future__ import annotations

import importlib.util
import itertools
import operator
import time
import warnings
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import sympy as sp

M1, M2, R = sp.symbols("m1 m2 r", positive=True)
_VARS = (M1, M2, R)
_U = sp.symbols("u1 u2 u3", real=True)  # median-scaled inputs seen by the GP backends
_TARGET = np.array([1.0, 1.0, -2.0])
BACKENDS = ("pyoperon", "gplearn", "pysr")
_INSTALL = {"pyoperon": "pip install pyoperon", "gplearn": "pip install gplearn"}
_PYSR_MSG = (
    "PySR needs Julia, which it downloads on first use (no network here); "
    "use backend='pyoperon' (pip install pyoperon) or backend='gplearn'"
)
Arr = np.ndarray


def _data(m1: Arr, m2: Arr, r: Arr, F: Arr | None = None, min_n: int = 8) -> list[Arr]:
    arrs = [np.asarray(x, dtype=np.float64).ravel() for x in (m1, m2, r, F) if x is not None]
    if len({a.size for a in arrs}) != 1 or arrs[0].size < min_n:
        raise ValueError(f"m1, m2, r, F must be 1-D arrays of one length >= {min_n}")
    for name, a in zip(("m1", "m2", "r", "F"), arrs, strict=False):
        if not np.all(np.isfinite(a)) or np.any(a <= 0):
            raise ValueError(f"{name} must be finite and positive (forces are magnitudes)")
    return arrs


def _r2(y: Arr, yhat: Arr) -> float:
    ss = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - yhat) ** 2)) / ss if ss > 0 else float("nan")


def installed_backends() -> list[str]:
    """SR backends importable here (pysr is listed only if its package is installed)."""
    return [b for b in BACKENDS if importlib.util.find_spec(b) is not None]


# --------------------------------------------------------------------------- power law
def power_law_fit(m1: Arr, m2: Arr, r: Arr, F: Arr, n_boot: int = 200, seed: int = 0) -> dict:
    """OLS ``log F = log G + alpha log m1 + beta log m2 + gamma log r``.

    Returns ``log_G``, ``G``, ``alpha``, ``beta``, ``gamma``, ``r2`` (= ``r2_log``, the R^2 of
    the log-space regression), ``r2_linear`` (R^2 of ``G m1^alpha m2^beta r^gamma`` vs ``F``),
    ``ci95`` (bootstrap 2.5 / 97.5 percentiles of each coefficient), ``formula``, ``n``.
    """
    m1, m2, r, F = _data(m1, m2, r, F)
    X = np.column_stack([np.ones_like(m1), np.log(m1), np.log(m2), np.log(r)])
    y = np.log(F)
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    names = ("log_G", "alpha", "beta", "gamma")
    boots = [np.empty((0, 4))]
    rng = np.random.default_rng(seed)
    for start in range(0, n_boot, 64):  # multinomial resampling weights, chunked for memory
        w = rng.multinomial(len(y), np.full(len(y), 1.0 / len(y)), size=min(64, n_boot - start))
        xtx, xty = np.einsum("bn,ni,nj->bij", w, X, X), np.einsum("bn,ni,n->bi", w, X, y)
        boots.append(np.einsum("bij,bj->bi", np.linalg.pinv(xtx), xty))
    bs = np.concatenate(boots)
    ci = {n: tuple(np.percentile(bs[:, i], [2.5, 97.5]).tolist()) for i, n in enumerate(names)}
    out: dict[str, Any] = dict(zip(names, coef.tolist(), strict=True))
    out.update(G=float(np.exp(coef[0])), r2_log=_r2(y, X @ coef), ci95=ci, n=len(y))
    out.update(r2=out["r2_log"], r2_linear=_r2(F, np.exp(X @ coef)))
    out["formula"] = "F = {:.6g} * m1**{:.4f} * m2**{:.4f} * r**{:.4f}".format(out["G"], *coef[1:])
    return out


def criteria(fit: dict, tol: float = 0.1, r2_min: float = 0.95) -> dict:
    """Pass/fail rules on a fit with ``alpha``, ``beta``, ``gamma``, ``r2`` (as returned by
    :func:`power_law_fit` and :func:`gp_symbolic_regression`).

    ``inverse_square``: ``|gamma + 2| <= tol``; ``newton``: also ``|alpha - 1| <= tol``,
    ``|beta - 1| <= tol`` and ``r2 >= r2_min``. ``reasons`` lists the failed conditions.
    """
    err = np.abs(np.array([fit["alpha"], fit["beta"], fit["gamma"]], dtype=float) - _TARGET)
    err = np.where(np.isfinite(err), err, np.inf)
    r2 = float(fit["r2"]) if np.isfinite(fit["r2"]) else -np.inf
    names = ("alpha", "beta", "gamma")
    reasons = [
        f"|{n} - {t:g}| = {e:.3g} > {tol}" for n, t, e in zip(names, _TARGET, err) if e > tol
    ]
    if r2 < r2_min:
        reasons.append(f"R^2 = {r2:.4f} < {r2_min}")
    out = {"inverse_square": bool(err[2] <= tol), "newton": not reasons, "reasons": reasons}
    return out | {f"{n}_err": float(e) for n, e in zip(names, err)}


# --------------------------------------------------------------------------- sparse search
LIBRARY: list[tuple[str, Callable[[Arr, Arr, Arr], Arr]]] = [
    ("log(m1)", lambda a, b, r: np.log(a)),
    ("log(m2)", lambda a, b, r: np.log(b)),
    ("log(r)", lambda a, b, r: np.log(r)),
    ("log(m1 + m2)", lambda a, b, r: np.log(a + b)),
    ("log(m1*m2/(m1 + m2))", lambda a, b, r: np.log(a * b / (a + b))),  # reduced mass
    ("r", lambda a, b, r: r),
    ("1/r", lambda a, b, r: 1.0 / r),
    ("r**2", lambda a, b, r: r**2),
    ("m1", lambda a, b, r: a),
    ("m2", lambda a, b, r: b),
    ("m1*m2", lambda a, b, r: a * b),
]


def _design(terms: Sequence[int], x: Sequence[Arr]) -> Arr:
    return np.column_stack([np.ones_like(x[0])] + [LIBRARY[k][1](*x) for k in terms])


def _library_exponents(c: Sequence[int], coef: Arr, x: Sequence[Arr], h: float = 1e-5) -> Arr:
    """Central-difference ``d log F / d log (m1, m2, r)`` of a fitted library law, ``(n, 3)``."""
    cols = []
    for i in range(3):
        up = [v * np.exp(h) if j == i else v for j, v in enumerate(x)]
        dn = [v * np.exp(-h) if j == i else v for j, v in enumerate(x)]
        cols.append((_design(c, up) @ coef - _design(c, dn) @ coef) / (2 * h))
    return np.stack(cols, axis=1)


def sparse_law_search(
    m1: Arr,
    m2: Arr,
    r: Arr,
    F: Arr,
    n_subsets: int = 5,
    seed: int = 0,
    max_terms: int = 3,
    subset_frac: float = 0.5,
    tol: float = 0.1,
    bic_margin: float = 2.0,
) -> dict:
    """Best-subset regression of ``log F`` on :data:`LIBRARY` terms (intercept always in).

    On each of ``n_subsets`` random subsets (``subset_frac`` of the data, seeded) every term
    set of size ``1 .. max_terms`` is fitted by least squares and scored by ``BIC = n log(
    max(RSS/n, 1e-16 var)) + (k + 1) log n``. Among the sets within ``bic_margin`` of the
    lowest BIC (2: no positive evidence either way) the one with fewest terms, then earliest
    in library order, wins, so near-equivalent bases such as ``{log m1, log m2, log r}`` and
    ``{log(m1+m2), log mu, log r}`` (both contain Newton's law) resolve to the primitive one
    instead of following the noise. Each subset reports ``terms``, ``coef``, ``formula``,
    ``bic``, ``r2``, ``exponents`` (median ``d log F / d log (m1, m2, r)`` of the fitted law)
    and ``is_newton`` (5th-95th percentiles of those within ``tol`` of (1, 1, -2)). Top level:
    ``agree`` (one term set everywhere), ``full`` / ``law`` (that set refitted on all data,
    else None) and ``is_newton`` (agree and every subset Newton).
    """
    m1, m2, r, F = _data(m1, m2, r, F)
    n = len(F)
    rng = np.random.default_rng(seed)
    combos = [
        c for k in range(1, max_terms + 1) for c in itertools.combinations(range(len(LIBRARY)), k)
    ]

    def fit(idx: Arr, only: tuple[int, ...] | None = None) -> dict:
        x, y = (m1[idx], m2[idx], r[idx]), np.log(F[idx])
        floor, nn = 1e-16 * max(float(np.var(y)), 1e-300), len(y)
        scored = []
        for c in [only] if only else combos:
            X = _design(c, x)
            coef = np.linalg.lstsq(X, y, rcond=None)[0]
            rss = float(np.sum((y - X @ coef) ** 2))
            scored.append((nn * np.log(max(rss / nn, floor)) + (len(c) + 1) * np.log(nn), c, coef))
        best = min(s[0] for s in scored)
        near = [s for s in scored if s[0] <= best + bic_margin]
        bic, c, coef = min(near, key=lambda s: (len(s[1]), s[1]))
        d = _library_exponents(c, coef, x)
        band = np.abs(np.percentile(d, [5, 95], axis=0) - _TARGET)
        terms = [LIBRARY[k][0] for k in c]
        formula = f"log(F) = {coef[0]:.4f}" + "".join(
            f" {'-' if w < 0 else '+'} {abs(w):.4f}*{t}" for w, t in zip(coef[1:], terms)
        )
        return {
            "terms": terms,
            "coef": coef.tolist(),
            "formula": formula,
            "bic": float(bic),
            "r2": _r2(y, _design(c, x) @ coef),
            "exponents": np.median(d, 0).tolist(),
            "is_newton": bool(np.all(band <= tol)),
            "index": c,
        }

    k_sub = min(n, max(8, int(round(subset_frac * n))))
    subsets = [fit(np.sort(rng.choice(n, k_sub, replace=False))) for _ in range(n_subsets)]
    agree = len({s["index"] for s in subsets}) == 1
    full = fit(np.arange(n), subsets[0]["index"]) if agree else None
    return {
        "subsets": subsets,
        "agree": agree,
        "full": full,
        "law": full["formula"] if full else None,
        "is_newton": bool(agree and all(s["is_newton"] for s in subsets)),
    }


# --------------------------------------------------------------------------- expressions
def _as_expr(expr: str | sp.Expr) -> sp.Expr:
    """Parse / normalise an expression in ``m1, m2, r`` onto the symbols M1, M2, R."""
    e = sp.sympify(expr, locals={"m1": M1, "m2": M2, "r": R}) if isinstance(expr, str) else expr
    by_name = {v.name: v for v in _VARS}
    return e.xreplace({s: by_name[s.name] for s in e.free_symbols if s.name in by_name})


def _num(expr: sp.Expr, syms: Sequence[sp.Symbol] = _VARS) -> Callable[..., Arr]:
    f = sp.lambdify(list(syms), expr, "numpy")

    def call(*args: Arr) -> Arr:
        with np.errstate(all="ignore"):
            return np.broadcast_to(np.asarray(f(*args), dtype=np.float64), np.shape(args[0]))

    return call


def _degenerate(e: sp.Expr) -> bool:
    return bool(e.has(sp.zoo, sp.oo, -sp.oo, sp.nan) or not e.free_symbols)


def power_law_exponents(
    expr: str | sp.Expr, m1: Arr | None = None, m2: Arr | None = None, r: Arr | None = None
) -> dict:
    """Local exponents ``d log F / d log (m1, m2, r)`` of ``expr`` over the data (default: a
    9^3 log grid on ``[0.1, 10]^3``): medians ``alpha``, ``beta``, ``gamma``, 5th / 95th
    percentiles ``p05``, ``p95`` (lists of 3) and ``valid`` (F finite and > 0 everywhere)."""
    e = _as_expr(expr)
    if m1 is None:
        x = [a.ravel() for a in np.meshgrid(*[np.logspace(-1, 1, 9)] * 3, indexing="ij")]
    else:
        x = _data(m1, m2, r, min_n=1)
    f = _num(e)(*x)
    d = np.stack([_num(sp.diff(e, v) * v / e)(*x) for v in _VARS], axis=1)
    if not (np.all(np.isfinite(f)) and np.all(f > 0) and np.all(np.isfinite(d))):
        nan = [float("nan")] * 3
        return dict(alpha=np.nan, beta=np.nan, gamma=np.nan, p05=nan, p95=nan, valid=False)
    med, (lo, hi) = np.median(d, axis=0), np.percentile(d, [5, 95], axis=0)
    out = dict(zip(("alpha", "beta", "gamma"), med.tolist(), strict=True))
    return out | dict(p05=lo.tolist(), p95=hi.tolist(), valid=True)


def is_newton(
    expr: str | sp.Expr,
    m1: Arr | None = None,
    m2: Arr | None = None,
    r: Arr | None = None,
    tol: float = 0.1,
) -> bool:
    """True when ``expr`` behaves as ``C m1^a m2^b r^c`` with ``a, b`` within ``tol`` of 1 and
    ``c`` within ``tol`` of -2: the 5th-95th percentiles of the local exponents
    (:func:`power_law_exponents`) over the data (or the default grid) must lie in the band."""
    ex = power_law_exponents(expr, m1, m2, r)
    band = np.abs(np.array([ex["p05"], ex["p95"]]) - _TARGET)
    return bool(ex["valid"] and np.all(band <= tol))


def newton_constant(expr: str | sp.Expr) -> float | None:
    """``C`` if ``expr`` simplifies exactly to ``C m1 m2 / r**2`` (C a nonzero number)."""
    ratio = sp.simplify(_as_expr(expr) * R**2 / (M1 * M2))
    return float(ratio) if ratio.is_number and ratio.is_real and ratio != 0 else None


def _complexity(expr: sp.Expr) -> int:
    return sum(1 for _ in sp.preorder_traversal(expr))


def _score(expr: sp.Expr, x: Sequence[Arr], F: Arr) -> float:
    """``n log(mean((Fhat/F - 1)^2) + 1e-20) + complexity log n`` (lower is better)."""
    rel = _num(expr)(*x) / F - 1.0
    val = len(F) * np.log(float(np.mean(rel**2)) + 1e-20) + _complexity(expr) * np.log(len(F))
    return float(val) if np.isfinite(val) else np.inf


def _refine(expr: sp.Expr, x: Sequence[Arr], F: Arr) -> sp.Expr:
    """Least-squares refinement of the Float constants on relative residuals ``Fhat/F - 1``."""
    from scipy.optimize import least_squares

    floats = sorted(expr.atoms(sp.Float), key=str)
    if not floats:
        return expr
    cs = sp.symbols(f"c0:{len(floats)}")
    f = _num(expr.xreplace(dict(zip(floats, cs, strict=True))), (*_VARS, *cs))

    def res(c: Arr) -> Arr:
        return np.nan_to_num(f(*x, *c) / F - 1.0, nan=1e6, posinf=1e6, neginf=-1e6)

    c0 = np.array([float(v) for v in floats])
    try:
        sol = least_squares(res, c0, xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=100 * len(c0))
    except (ValueError, np.linalg.LinAlgError):
        return expr
    if not np.sum(res(sol.x) ** 2) <= np.sum(res(c0) ** 2):
        return expr
    return expr.xreplace({v: sp.Float(c, 15) for v, c in zip(floats, sol.x, strict=True)})


def _snap(expr: sp.Expr, rel: float = 1e-6) -> sp.Expr:
    """Replace Floats within ``rel`` (relative) of a fraction with denominator <= 12 by it."""
    rep = {}
    for c in expr.atoms(sp.Float):
        q = Fraction(float(c)).limit_denominator(12)
        if abs(float(q) - float(c)) <= rel * abs(float(c)):
            rep[c] = sp.Rational(q.numerator, q.denominator)
    return expr.xreplace(rep)


def _finalise(expr: sp.Expr, x: Sequence[Arr], F: Arr) -> tuple[sp.Expr, float]:
    """simplify, refine constants, greedily drop additive terms while :func:`_score` improves
    (removes noise-fitted offsets), snap constants; returns the expression and its score."""
    best = _refine(sp.simplify(expr), x, F)
    score = _score(best, x, F)
    while True:
        terms = sp.Add.make_args(sp.expand(best))
        if len(terms) < 2:
            break
        trials = [_refine(sp.Add(*terms[:k], *terms[k + 1 :]), x, F) for k in range(len(terms))]
        new_score, k = min((_score(t, x, F), k) for k, t in enumerate(trials))
        if new_score >= score:
            break
        score, best = new_score, trials[k]
    final = _snap(sp.simplify(_snap(best)))
    return final, _score(final, x, F)


# --------------------------------------------------------------------------- GP backends
def _run_pyoperon(
    X: Arr, y: Arr, seed: int, budget: float, ops: Sequence[str], size: int, pop: int, gens: int
) -> list[sp.Expr]:
    from pyoperon.sklearn import SymbolicRegressor

    est = SymbolicRegressor(
        allowed_symbols=",".join([*ops, "constant", "variable"]),
        max_length=size,
        population_size=pop,
        generations=gens,
        objectives=["r2", "length"],
        optimizer_iterations=5,
        random_state=seed,
        n_threads=1,
        max_time=max(1, int(budget)),
    )
    est.fit(X, y)
    names, loc = [u.name for u in _U], {u.name: u for u in _U}
    return [
        sp.sympify(est.get_model_string(p["tree"], 12, names), locals=loc)
        for p in est.pareto_front_
    ]


def _run_gplearn(
    X: Arr, y: Arr, seed: int, budget: float, ops: Sequence[str], size: int, pop: int, gens: int
) -> list[sp.Expr]:
    from gplearn.functions import make_function
    from gplearn.genetic import SymbolicRegressor

    sq = make_function(function=np.square, name="square", arity=1)
    est = SymbolicRegressor(
        population_size=pop,
        generations=1,
        function_set=[sq if o == "square" else o for o in ops],
        metric="pearson",
        parsimony_coefficient=0.001,
        random_state=seed,
        n_jobs=1,
        const_range=(-1.0, 1.0),
        init_depth=(2, 4),
        stopping_criteria=1.0 - 1e-12,
        warm_start=True,
    )
    deadline = time.perf_counter() + budget
    with warnings.catch_warnings():  # one generation per fit (warm start) to honour the budget
        warnings.simplefilter("ignore")
        for g in range(1, gens + 1):
            est.set_params(generations=g)
            est.fit(X, y)
            if est._program.raw_fitness_ >= 1.0 - 1e-12 or time.perf_counter() > deadline:
                break
    loc: dict[str, Any] = {f"X{i}": u for i, u in enumerate(_U)}
    loc.update(
        add=operator.add,
        sub=operator.sub,
        mul=operator.mul,
        div=operator.truediv,
        square=lambda a: a**2,
    )
    top = sorted(est._programs[-1], key=lambda p: -p.raw_fitness_)[:5]
    out = []
    for prog in dict.fromkeys(str(p) for p in [est._program, *top]):
        e = sp.sympify(prog, locals=loc)
        if _degenerate(e):  # e.g. x / (y - y), which gplearn's protected division hides
            continue
        f = _num(e, _U)(*X.T)
        if np.all(np.isfinite(f)) and np.ptp(f) > 0:  # pearson fitness: refit scale + offset
            A, B = np.linalg.lstsq(np.column_stack([f, np.ones_like(f)]), y, rcond=None)[0]
            out.append(sp.Float(A) * e + sp.Float(B))
    return out


def _run_pysr(
    X: Arr, y: Arr, seed: int, budget: float, ops: Sequence[str], size: int, pop: int, gens: int
) -> list[sp.Expr]:  # pragma: no cover
    try:
        from pysr import PySRRegressor
    except Exception as exc:  # juliacall fails at import time without Julia / network
        raise ImportError(_PYSR_MSG) from exc
    sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
    model = PySRRegressor(
        binary_operators=[sym[o] for o in ops if o in sym],
        maxsize=size,
        niterations=gens,
        unary_operators=["square"] if "square" in ops else [],
        population_size=pop,
        timeout_in_seconds=budget,
        random_state=seed,
        deterministic=True,
        parallelism="serial",
    )
    model.fit(X, y, variable_names=[u.name for u in _U])
    by_name = {u.name: u for u in _U}
    out = [model.sympy(i) for i in range(len(model.equations_))]
    return [e.xreplace({s: by_name[s.name] for s in e.free_symbols}) for e in out]


_RUNNERS = {"pyoperon": _run_pyoperon, "gplearn": _run_gplearn, "pysr": _run_pysr}
_DEFAULTS = {"pyoperon": (500, 100), "gplearn": (2000, 20), "pysr": (50, 40)}  # (pop, gens)


def _resolve_backend(backend: str) -> str:
    have = installed_backends()
    if backend == "auto":  # PySR is never chosen automatically: it downloads Julia
        for b in ("pyoperon", "gplearn"):
            if b in have:
                return b
        raise ImportError(
            "no symbolic-regression backend installed: pip install pyoperon "
            "(recommended) or pip install gplearn"
        )
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown SR backend {backend!r}; installed: {have or 'none'}; "
            f"supported: {list(BACKENDS)} (e.g. pip install pyoperon)"
        )
    if backend == "pysr" and "pysr" not in have:
        raise ImportError(_PYSR_MSG)
    if backend not in have:
        raise ImportError(f"backend {backend!r} is not installed: {_INSTALL[backend]}")
    return backend


def gp_symbolic_regression(
    m1: Arr,
    m2: Arr,
    r: Arr,
    F: Arr,
    backend: str = "auto",
    seed: int = 0,
    time_budget_s: float = 60.0,
    log_space: bool = False,
    n_restarts: int = 3,
    target_r2: float = 1.0 - 1e-9,
    operators: Sequence[str] = ("add", "sub", "mul", "div"),
    max_length: int = 15,
    population_size: int | None = None,
    generations: int | None = None,
    max_points: int = 2000,
    tol: float = 0.1,
) -> dict:
    """Genetic-programming SR of ``F(m1, m2, r)`` with simplification and a Newton check.

    Search space: by default the raw inputs and target divided by their medians (undone in
    the final expression) combined with ``operators`` (``"square"`` may be added).
    ``log_space=True`` (an option, not the default) fits ``log F`` on the logs of the scaled
    inputs instead and returns ``exp(...)``. At most ``max_points`` (seeded) points are used.

    Restarts: run ``i`` uses seed ``seed + 1000 i``; restarting stops once a candidate reaches
    ``target_r2`` or when the time left of ``time_budget_s`` (wall clock) is shorter than the
    previous run. A run gets the time left (pyoperon ``max_time``; gplearn is stepped one
    generation at a time), so results are deterministic in ``seed`` unless the budget bites.

    Candidates (pyoperon: the Pareto front of R^2 vs length; gplearn: the best and top final
    programs, rescaled by least squares) are simplified with sympy, their constants refined
    on relative residuals, additive terms dropped while that lowers the score, constants
    snapped to simple fractions; the winner minimises ``n log(mean rel. residual^2) +
    complexity log n`` (complexity = sympy tree nodes).

    Returns ``expression`` (str), ``sympy``, ``complexity``, ``r2`` (linear), ``r2_log``,
    ``alpha`` / ``beta`` / ``gamma`` (median local exponents) with ``exponents_p05`` /
    ``_p95``, ``is_newton``, ``newton_G`` (C if exactly ``C m1 m2 / r**2``), ``criteria``,
    ``candidates`` (expr, complexity, r2), ``backend``, ``restarts``, ``seconds``.
    """
    m1, m2, r, F = _data(m1, m2, r, F)
    backend = _resolve_backend(backend)
    t0 = time.perf_counter()
    idx = np.arange(len(F))
    if len(F) > max_points:
        idx = np.sort(np.random.default_rng(seed).choice(len(F), max_points, replace=False))
    x, Fs = [v[idx] for v in (m1, m2, r)], F[idx]
    scale, sF = [float(np.median(v)) for v in x], float(np.median(Fs))
    X, y = np.column_stack([v / s for v, s in zip(x, scale)]), Fs / sF
    if log_space:
        X, y = np.log(X), np.log(y)
    undo = {u: (sp.log(v / s) if log_space else v / s) for u, v, s in zip(_U, _VARS, scale)}
    pop, gens = _DEFAULTS[backend]
    pop, gens = population_size or pop, generations or gens
    cands: dict[str, tuple[float, sp.Expr, float]] = {}
    attempts, last = 0, 0.0
    for attempt in range(max(1, n_restarts)):
        left = time_budget_s - (time.perf_counter() - t0)
        if attempt > 0 and left < last:  # another run would likely overshoot the budget
            break
        attempts, t_run = attempts + 1, time.perf_counter()
        raw = _RUNNERS[backend](
            X, y, seed + 1000 * attempt, max(1.0, left), tuple(operators), max_length, pop, gens
        )
        for e in raw:
            e = e.xreplace(undo)
            if _degenerate(e):
                continue
            try:
                e, score = _finalise(sF * (sp.exp(e) if log_space else e), x, Fs)
            except Exception:  # a degenerate GP candidate (overflow, bad parse...) is skipped
                continue
            if np.isfinite(score) and str(e) not in cands:
                cands[str(e)] = (score, e, _r2(Fs, _num(e)(*x)))
        last = time.perf_counter() - t_run
        if cands and max(c[2] for c in cands.values()) >= target_r2:
            break
    if not cands:
        raise RuntimeError(f"{backend} returned no usable expression")
    best = min(cands.values(), key=lambda c: c[0])[1]
    fh = _num(best)(m1, m2, r)
    ex = power_law_exponents(best, m1, m2, r)
    out = {
        "backend": backend,
        "expression": str(best),
        "sympy": best,
        "complexity": _complexity(best),
        "r2": _r2(F, fh),
        "r2_log": _r2(np.log(F), np.log(fh)) if np.all(fh > 0) else float("nan"),
        "alpha": ex["alpha"],
        "beta": ex["beta"],
        "gamma": ex["gamma"],
        "exponents_p05": ex["p05"],
        "exponents_p95": ex["p95"],
        "is_newton": is_newton(best, m1, m2, r, tol),
        "newton_G": newton_constant(best),
        "candidates": sorted(
            ((k, _complexity(c[1]), c[2]) for k, c in cands.items()), key=lambda t: t[1]
        ),
        "restarts": attempts,
        "seconds": time.perf_counter() - t0,
        "log_space": log_space,
    }
    return out | {"criteria": criteria(out, tol)}
