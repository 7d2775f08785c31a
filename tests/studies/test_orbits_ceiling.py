"""Tests for lssar.studies.orbits.ceiling (the noise ceiling).

The ceiling is checked where its answer is known: the exact law seen through i.i.d. noise of a
known size has exponents centred on (1, 1, -2) and R^2 = var(log F) / (var(log F) + sigma^2); a
probe that *is* the exact law plus such noise lies within its ceiling about 95% of the time, and
a probe with a wrong law (shrunk mass exponents) never does.
"""

import numpy as np
import pytest

from lssar.studies.orbits import ceiling, kepler, symreg

S, K, N = 300, 24, 400  # test systems, steps, SR points (the quick preset's sizes)


def _truth(seed=0):
    """True (m1, m2 per system; r, log F per system and step) of generated orbits."""
    d = kepler.generate(kepler.preset("quick", n_systems=S, n_steps=K, seed=seed))
    return d["masses"][:, 0], d["masses"][:, 1], d["r"], np.log(d["force_mag"])


def _points(seed=0):
    rng = np.random.default_rng(seed)
    flat = rng.choice(S * K, N, replace=False)
    return flat // K, flat % K


def _run(log_f_pred, truth, systems, steps, seed=0, n_draws=200):
    """One probe's power-law error and its ceiling, as the runner computes them."""
    m1, m2, r, log_f = truth
    x = m1[systems], m2[systems], r[systems, steps]
    fit = symreg.power_law_fit(*x, np.exp(log_f_pred[systems, steps]), n_boot=50, seed=seed)
    ceil = ceiling.noise_ceiling(
        *x, log_f[systems, steps], log_f_pred - log_f, systems, steps, n_draws, seed
    )
    return fit, ceil


def test_exact_law_with_known_noise_has_known_exponents_and_r2():
    m1, m2, r, log_f = truth = _truth()
    systems, steps = _points()
    sigma = 0.3
    noisy = log_f + sigma * np.random.default_rng(1).standard_normal(log_f.shape)
    fit, ceil = _run(noisy, truth, systems, steps)
    for k, t in zip(ceiling.EXPONENTS, ceiling.TARGET):
        lo, hi = fit["ci95"][k]
        assert lo < t < hi  # the probe's own exponents: Newton within their bootstrap interval
        b_lo, b_hi = ceil["band"][k]
        assert b_lo < t < b_hi and abs(ceil[k] - t) < 0.25 * (b_hi - b_lo)  # centred on Newton
    v = np.var(log_f[systems, steps])
    assert ceil["r2"] == pytest.approx(v / (v + sigma**2), abs=0.02)
    assert ceil["resid_sd"] == pytest.approx(sigma, rel=0.02)
    assert ceil["max_err"] < ceil["max_err_q95"] and ceil["n_draws"] == 200


def test_exact_law_lies_within_its_ceiling_and_a_wrong_law_does_not():
    truth = _truth()
    m1, m2, r, log_f = truth
    lm = np.log(np.stack([m1, m2], 1))
    shrunk = log_f - 0.3 * (lm - lm.mean(0)).sum(1, keepdims=True)  # alpha, beta = 0.7: not Newton
    within = {"exact": 0, "wrong": 0}
    trials = 40
    for t in range(trials):
        systems, steps = _points(seed=100 + t)
        noise = 0.3 * np.random.default_rng(t).standard_normal(log_f.shape)
        for name, law in (("exact", log_f), ("wrong", shrunk)):
            fit, ceil = _run(law + noise, truth, systems, steps, seed=t, n_draws=100)
            within[name] += ceiling.exponent_errors(fit)["max_err"] <= ceil["max_err_q95"]
    assert within["exact"] >= 0.85 * trials  # 95% expected: the ceiling is calibrated
    assert within["wrong"] == 0


def test_noise_is_permuted_by_system_and_keeps_the_step():
    resid = 100.0 * np.arange(S)[:, None] + np.arange(K)[None, :]  # encodes (system, step)
    systems, steps = _points()
    noise = ceiling.ceiling_noise(resid, systems, steps, n_draws=5, seed=0)
    assert noise.shape == (5, N)
    donor, step = np.divmod(noise, 100.0)
    assert np.array_equal(step, np.broadcast_to(steps, (5, N)))  # same step of another system
    for d in range(5):  # one donor per system: points of one system share their noise
        pairs = set(zip(systems.tolist(), donor[d].tolist()))
        assert len(pairs) == len(set(systems.tolist()))
        assert len({b for _, b in pairs}) == len(pairs)  # a permutation: donors distinct
    assert not np.array_equal(donor[0], systems)
    again = ceiling.ceiling_noise(resid, systems, steps, n_draws=5, seed=0)
    assert np.array_equal(noise, again)  # seeded


def test_vectorised_fits_match_the_power_law_fit():
    m1, m2, r, log_f = _truth()
    systems, steps = _points()
    x = m1[systems], m2[systems], r[systems, steps]
    noise = 0.2 * np.random.default_rng(2).standard_normal((3, N))
    fits = ceiling.ceiling_fits(*x, log_f[systems, steps], noise)
    for d in range(3):
        ref = symreg.power_law_fit(*x, np.exp(log_f[systems, steps] + noise[d]), n_boot=1)
        for k in (*ceiling.EXPONENTS, "r2"):
            assert fits[k][d] == pytest.approx(ref[k], abs=1e-10)
        assert fits["max_err"][d] == pytest.approx(ceiling.exponent_errors(ref)["max_err"])


def test_exponent_errors_and_bad_inputs():
    e = ceiling.exponent_errors({"alpha": 0.8, "beta": 1.1, "gamma": -2.05})
    assert e == pytest.approx(
        {"alpha_err": 0.2, "beta_err": 0.1, "gamma_err": 0.05, "max_err": 0.2}
    )
    assert ceiling.exponent_errors({"alpha": np.nan, "beta": 1, "gamma": -2})["max_err"] == np.inf
    systems, steps = _points()
    with pytest.raises(ValueError, match="finite"):
        ceiling.ceiling_noise(np.full((S, K), np.nan), systems, steps, 3, 0)
    with pytest.raises(ValueError, match="n_draws"):
        ceiling.ceiling_noise(np.zeros((S, K)), systems, steps, 0, 0)
