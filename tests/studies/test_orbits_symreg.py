"""Tests for lssar.studies.orbits.symreg: power-law fit, sparse law search, GP SR."""

import numpy as np
import pytest
import sympy as sp

from lssar.studies.orbits import kepler, symreg

G_AU = 4 * np.pi**2  # AU^3 / (M_sun yr^2): a non-trivial constant the SR has to recover


def _oracle(n=500, seed=0, G=G_AU):
    """(m1, m2, r, F) sampled from generated orbits: random systems and time steps."""
    d = kepler.generate(kepler.preset("quick", n_systems=n, n_steps=32, G=G, seed=seed))
    step = np.random.default_rng(seed).integers(0, 32, n)
    r = d["r"][np.arange(n), step]
    return d["masses"][:, 0], d["masses"][:, 1], r, d["force_mag"][np.arange(n), step]


def test_power_law_fit_exact_newton():
    m1, m2, r, F = _oracle()
    fit = symreg.power_law_fit(m1, m2, r, F, n_boot=200, seed=0)
    assert fit["alpha"] == pytest.approx(1, abs=1e-9) and fit["beta"] == pytest.approx(1, abs=1e-9)
    assert fit["gamma"] == pytest.approx(-2, abs=1e-9) and fit["G"] == pytest.approx(G_AU, rel=1e-9)
    for name in ("alpha", "beta", "gamma", "log_G"):
        lo, hi = fit["ci95"][name]
        assert lo <= fit[name] + 1e-12 and hi >= fit[name] - 1e-12 and hi - lo < 1e-8
    assert fit["r2_log"] > 0.999999 and fit["r2_linear"] > 0.999999
    crit = symreg.criteria(fit)
    assert crit["newton"] and crit["inverse_square"] and crit["reasons"] == []


def test_power_law_fit_detects_wrong_laws():
    m1, m2, r, _ = _oracle()
    crit = symreg.criteria(symreg.power_law_fit(m1, m2, r, m1 / r))
    assert not crit["newton"] and not crit["inverse_square"]
    crit = symreg.criteria(symreg.power_law_fit(m1, m2, r, m1 / r**2))  # beta = 0
    assert crit["inverse_square"] and not crit["newton"] and "beta" in crit["reasons"][0]
    noise = np.random.default_rng(1).lognormal(0, 1.0, len(r))  # right exponents, R^2 too low
    fit = symreg.power_law_fit(m1, m2, r, m1 * m2 / r**2 * noise)
    assert fit["r2"] < 0.95 and not symreg.criteria(fit)["newton"]
    fit = symreg.power_law_fit(m1, m2, r, m1 * m2 / r**2 * noise**0.02)
    lo, hi = fit["ci95"]["gamma"]
    assert symreg.criteria(fit)["newton"] and lo < -2 < hi


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_sparse_search_picks_newton_terms(noise):
    m1, m2, r, F = _oracle(seed=2)
    F = F * np.exp(noise * np.random.default_rng(3).standard_normal(len(F)))
    res = symreg.sparse_law_search(m1, m2, r, F, n_subsets=5, seed=0)
    assert res["agree"] and res["is_newton"] and len(res["subsets"]) == 5
    for sub in res["subsets"]:
        assert sub["terms"] == ["log(m1)", "log(m2)", "log(r)"]
        assert np.allclose(sub["exponents"], [1, 1, -2], atol=0.05)
    assert res["law"].startswith("log(F) = ") and "log(m1)" in res["law"]


def test_sparse_search_wrong_law_not_newton():
    m1, m2, r, _ = _oracle(seed=2)
    res = symreg.sparse_law_search(m1, m2, r, m1 * np.exp(-r), n_subsets=3)
    assert res["agree"] and not res["is_newton"]
    assert res["subsets"][0]["terms"] == ["log(m1)", "r"]


def test_is_newton_and_constant():
    assert symreg.is_newton("39.47*m1*m2/r**2")
    assert symreg.is_newton("m1*m2/r**2 + 1e-4*m1")  # numerically a power law
    for wrong in ("m1*m2/r", "(m1 + m2)*m1*m2/r**2", "-m1*m2/r**2", "m1/r**2", "m1*m2/r**2 + 1"):
        assert not symreg.is_newton(wrong)
    x = symreg.M1, symreg.M2, symreg.R
    assert symreg.newton_constant(2 * x[0] * x[1] / x[2] ** 2) == pytest.approx(2)
    assert symreg.newton_constant("m1*m2*r**(-2)*3/4") == pytest.approx(0.75)
    assert symreg.newton_constant("m1/r") is None
    ex = symreg.power_law_exponents("m1**1.5*m2/r**3")
    assert (ex["alpha"], ex["beta"], ex["gamma"]) == pytest.approx((1.5, 1.0, -3.0))


@pytest.mark.parametrize("backend", ["pyoperon", "gplearn"])
def test_gp_oracle_recovers_newton(backend):
    pytest.importorskip(backend)
    m1, m2, r, F = _oracle(seed=4)
    res = symreg.gp_symbolic_regression(m1, m2, r, F, backend=backend, seed=0, time_budget_s=20)
    G = res["newton_G"]
    assert G is not None and abs(G / G_AU - 1) < 1e-3, res["expression"]
    g = sp.Symbol("G", positive=True)
    law = g * symreg.M1 * symreg.M2 / symreg.R**2
    assert sp.simplify(res["sympy"] - law.subs(g, G)) == 0
    assert res["is_newton"] and res["criteria"]["newton"] and res["r2"] > 1 - 1e-9
    assert res["complexity"] <= 8 and res["seconds"] < 40
    for key in ("alpha", "beta", "gamma"):
        assert res[key] == pytest.approx({"alpha": 1, "beta": 1, "gamma": -2}[key], abs=1e-6)


def test_gp_wrong_law_is_not_newton():
    pytest.importorskip("gplearn")
    m1, m2, r, _ = _oracle(seed=5)
    res = symreg.gp_symbolic_regression(m1, m2, r, 3 * m1 / r, backend="gplearn", time_budget_s=20)
    assert sp.simplify(res["sympy"] - 3 * symreg.M1 / symreg.R) == 0
    assert not res["is_newton"] and not res["criteria"]["newton"] and res["newton_G"] is None


def test_gp_log_space_option():
    pytest.importorskip("gplearn")
    m1, m2, r, F = _oracle(n=300, seed=6)
    res = symreg.gp_symbolic_regression(
        m1, m2, r, F, backend="gplearn", log_space=True, time_budget_s=20
    )
    assert res["log_space"] and res["is_newton"]
    assert res["newton_G"] == pytest.approx(G_AU, rel=1e-3)


def test_backend_errors(monkeypatch):
    m1, m2, r, F = _oracle(n=50)
    with pytest.raises(ValueError, match="unknown SR backend") as err:
        symreg.gp_symbolic_regression(m1, m2, r, F, backend="eureqa")
    for name in symreg.installed_backends():
        assert name in str(err.value)
    assert "pip install" in str(err.value)
    monkeypatch.setattr(symreg, "installed_backends", lambda: ["gplearn"])
    with pytest.raises(ImportError, match="Julia.*pyoperon"):
        symreg.gp_symbolic_regression(m1, m2, r, F, backend="pysr")
    with pytest.raises(ImportError, match="pip install pyoperon"):
        symreg.gp_symbolic_regression(m1, m2, r, F, backend="pyoperon")
    monkeypatch.setattr(symreg, "installed_backends", lambda: [])
    with pytest.raises(ImportError, match="pip install pyoperon"):
        symreg.gp_symbolic_regression(m1, m2, r, F, backend="auto")


def test_bad_data_raises():
    m1, m2, r, F = _oracle(n=50)
    for bad in (-F, np.where(np.arange(50) == 3, np.nan, F), F[:-1]):
        with pytest.raises(ValueError):
            symreg.power_law_fit(m1, m2, r, bad)
        with pytest.raises(ValueError):
            symreg.sparse_law_search(m1, m2, r, bad)
    with pytest.raises(ValueError):
        symreg.gp_symbolic_regression(m1, m2, -r, F, backend="gplearn")
