"""The noise ceiling of the Newton criterion: the exact law seen through a probe's own noise.

A force probe's predictions ``log F̂`` differ from the truth by residuals ``e = log F̂ - log F``.
Even a probe whose *law* were exactly Newton's would, with residuals of that size, fit power-law
exponents that scatter around (1, 1, -2) and an R² well below 1. The ceiling measures that: the
true ``log F`` on the same symbolic-regression points plus residuals drawn from the probe's
measured ones, fitted by the same power law, ``n_draws`` times.

How the residuals are drawn (:func:`ceiling_noise`): each draw permutes the *test systems* and
gives point ``(system s, step k)`` the residual the probe made at ``(system perm[s], step k)``.
That keeps everything about the noise except its link to the point's own ``(m1, m2, r)``: its
distribution (tails included, no Gaussian assumption), its size at each step (early steps have
less history), and its correlation within a system (a probe misjudges a system's masses at
every step at once, so points of one system share their error). What it removes is exactly what
a wrong law would leave: residuals that vary with the masses or the distance (e.g. mass
estimates shrunk towards the mean, which pulls α and β below 1). So an arm whose exponents are
no further from Newton than its ceiling's has residuals indistinguishable, for the power law,
from noise around the exact law; one that is further has a law that is not Newton's.

All arrays are float64; ``n`` is the number of SR points, ``S`` / ``K`` the test systems /
steps of the residual matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TARGET = np.array([1.0, 1.0, -2.0])  # Newton's exponents of (m1, m2, r)
EXPONENTS = ("alpha", "beta", "gamma")
ERRORS = ("alpha_err", "beta_err", "gamma_err", "max_err")


def exponent_errors(fit: dict[str, Any]) -> dict[str, float]:
    """``|α - 1|``, ``|β - 1|``, ``|γ + 2|`` and their maximum for a fit with ``alpha``,
    ``beta``, ``gamma`` (a non-finite exponent counts as infinitely far)."""
    e = np.abs(np.array([fit[k] for k in EXPONENTS], dtype=float) - TARGET)
    e = np.where(np.isfinite(e), e, np.inf)
    return dict(zip(ERRORS, [*e.tolist(), float(e.max())], strict=True))


def ceiling_noise(
    resid: np.ndarray, systems: np.ndarray, steps: np.ndarray, n_draws: int, seed: int
) -> np.ndarray:
    """``(n_draws, n)`` residuals for the SR points ``(systems[i], steps[i])`` (indices into
    ``resid (S, K)``): draw ``d`` gives point ``i`` the residual ``resid[perm_d[systems[i]],
    steps[i]]`` with ``perm_d`` a seeded permutation of the ``S`` systems (see the module
    docstring for why systems, not points, are permuted)."""
    resid = np.asarray(resid, dtype=np.float64)
    if resid.ndim != 2 or not np.all(np.isfinite(resid)):
        raise ValueError(f"resid must be a finite (S, K) matrix, got shape {resid.shape}")
    if n_draws < 1:
        raise ValueError(f"n_draws must be >= 1, got {n_draws}")
    rng = np.random.default_rng([seed, 2501])
    perms = np.stack([rng.permutation(resid.shape[0]) for _ in range(n_draws)])  # (D, S)
    return resid[perms[:, systems], steps[None, :]]


def ceiling_fits(
    m1: np.ndarray, m2: np.ndarray, r: np.ndarray, log_f: np.ndarray, noise: np.ndarray
) -> dict[str, np.ndarray]:
    """The power law ``log F = c + α log m1 + β log m2 + γ log r`` (least squares, as
    :func:`lssar.studies.orbits.symreg.power_law_fit`) fitted to ``log_f (n,) + noise[d]`` for
    every draw ``d`` of ``noise (D, n)``: arrays ``(D,)`` of ``alpha``, ``beta``, ``gamma``,
    ``r2`` (of the log-space fit) and the errors of :data:`ERRORS`."""
    X = np.column_stack([np.ones_like(m1), np.log(m1), np.log(m2), np.log(r)])  # (n, 4)
    Y = log_f[None, :] + noise  # (D, n)
    coef = np.linalg.lstsq(X, Y.T, rcond=None)[0].T  # (D, 4)
    ss_res = np.sum((Y - coef @ X.T) ** 2, axis=1)
    ss_tot = np.sum((Y - Y.mean(axis=1, keepdims=True)) ** 2, axis=1)
    err = np.abs(coef[:, 1:] - TARGET)  # (D, 3)
    out = dict(zip(EXPONENTS, coef[:, 1:].T, strict=True))
    out.update(zip(ERRORS, [*err.T, err.max(axis=1)], strict=True))
    out["r2"] = 1.0 - ss_res / ss_tot
    return out


def noise_ceiling(
    m1: np.ndarray,
    m2: np.ndarray,
    r: np.ndarray,
    log_f: np.ndarray,
    resid: np.ndarray,
    systems: np.ndarray,
    steps: np.ndarray,
    n_draws: int = 200,
    seed: int = 0,
) -> dict[str, Any]:
    """The ceiling of one probe on one seed's SR points (true ``m1, m2, r, log_f (n,)``; the
    probe's residual matrix ``resid (S, K)``; the points' ``systems``, ``steps (n,)``).

    Returns, over ``n_draws`` draws of :func:`ceiling_noise`: the mean of each exponent, error
    and R² (``alpha``, ..., ``max_err``, ``r2``: what an estimator with this noise and the exact
    law gets on average, the value compared with the arm's), ``max_err_q95`` (the 95th
    percentile of the largest error: a single run beyond it is further from Newton than this
    noise makes likely), ``band`` (2.5 / 97.5 percentiles of each exponent), ``resid_sd`` (of
    the residual matrix), ``n_draws``, ``method``, and ``noise0`` ``(n,)``, the first draw's
    noise, for the full SR pipeline to be run once on ``log_f + noise0``."""
    noise = ceiling_noise(resid, systems, steps, n_draws, seed)
    fits = ceiling_fits(m1, m2, r, log_f, noise)
    out: dict[str, Any] = {k: float(np.mean(v)) for k, v in fits.items()}
    out.update(
        max_err_q95=float(np.percentile(fits["max_err"], 95)),
        band={k: np.percentile(fits[k], [2.5, 97.5]).tolist() for k in EXPONENTS},
        resid_sd=float(np.std(resid)),
        n_draws=int(n_draws),
        method="true log F + the probe's residuals, test systems permuted (per draw)",
        noise0=noise[0],
    )
    return out
