"""Tests for lssar.studies.orbits.kepler: closed-form orbits, splits and token formats."""

import json
import os

import numpy as np
import pytest

from lssar.studies.orbits import kepler as k


def _small(**kw):
    base = dict(n_systems=24, n_steps=400, steps_per_orbit=2000.0, e_max=0.6, com_vel_scale=0.3)
    return k.preset("quick", **{**base, **kw})


def test_solve_kepler_residual():
    rng = np.random.default_rng(0)
    M = rng.uniform(-10, 10, 5000)
    e = rng.uniform(0, 0.99, 5000)
    E = k.solve_kepler(M, e)
    Mred = np.mod(M + np.pi, 2 * np.pi) - np.pi
    assert np.max(np.abs(E - e * np.sin(E) - Mred)) < 1e-12


def test_finite_difference_force_matches_newton():
    d = k.generate(_small())
    m1, m2 = d["masses"].T
    acc = k.finite_difference_accel(d["positions"], d["dt"])
    assert acc.shape == (24, 398, 2, 2)
    F = d["force_mag"][:, 1:-1]
    for body, m in ((1, m2), (0, m1)):
        fd = m[:, None] * np.linalg.norm(acc[:, :, body], axis=-1)
        assert np.max(np.abs(fd / F - 1)) < 0.01
    # the force vectors point the right way: m a ~ F_vec
    fd_vec = m2[:, None, None] * acc[:, :, 1]
    assert np.max(np.linalg.norm(fd_vec - d["force_vec"][:, 1:-1, 1], axis=-1) / F) < 0.01


def test_momentum_and_centre_of_mass():
    d = k.generate(_small())
    m1, m2 = d["masses"].T
    mt = (m1 + m2)[:, None, None]
    com = m1[:, None, None] * d["positions"][:, :, 0] + m2[:, None, None] * d["positions"][:, :, 1]
    expect = d["x_cm0"][:, None, :] + d["v_cm"][:, None, :] * d["t"][..., None]
    assert np.max(np.abs(com / mt - expect)) < 1e-12
    v = d["velocities"]
    p = m1[:, None, None] * v[:, :, 0] + m2[:, None, None] * v[:, :, 1]
    assert np.max(np.abs(p - mt * d["v_cm"][:, None, :])) < 1e-12
    # the closed-form velocities are the time derivatives of the positions
    fd_v = (d["positions"][:, 2:] - d["positions"][:, :-2]) / (2 * d["dt"][:, None, None, None])
    scale = np.max(np.abs(v), axis=(1, 2, 3))[:, None, None, None]
    assert np.max(np.abs(fd_v - v[:, 1:-1]) / scale) < 1e-3


def test_energy_and_angular_momentum_conserved():
    d = k.generate(_small(com_vel_scale=0.0))
    m1, m2 = d["masses"].T
    v, x = d["velocities"], d["positions"]
    kin = 0.5 * (
        m1[:, None] * np.sum(v[:, :, 0] ** 2, -1) + m2[:, None] * np.sum(v[:, :, 1] ** 2, -1)
    )
    E = kin - d["G"] * (m1 * m2)[:, None] / d["r"]
    assert np.max(np.abs(E / E[:, :1] - 1)) < 1e-9
    # two-body energy in the COM frame is -G m1 m2 / (2a)
    assert np.allclose(E[:, 0], -d["G"] * m1 * m2 / (2 * d["a"]), rtol=1e-10)
    L = sum(
        m[:, None] * (x[:, :, b, 0] * v[:, :, b, 1] - x[:, :, b, 1] * v[:, :, b, 0])
        for b, m in ((0, m1), (1, m2))
    )
    assert np.max(np.abs(L / L[:, :1] - 1)) < 1e-9


def test_circular_orbit_and_period():
    d = k.generate(_small(e_max=0.0, com_vel_scale=0.0))
    assert np.max(np.abs(d["r"] / d["a"][:, None] - 1)) < 1e-12
    cfg = _small()
    d = k.generate(cfg)
    S = cfg.n_systems
    orb = k.kepler_orbit(
        d["masses"][:, 0],
        d["masses"][:, 1],
        d["a"],
        d["e"],
        d["omega"],
        d["M0"],
        np.stack([np.zeros(S), d["period"]], 1),
        cfg.G,
    )
    assert np.max(np.abs(orb["rel"][:, 1] - orb["rel"][:, 0])) < 1e-9


def test_generate_sampling_and_presets():
    cfg = k.preset("quick")
    d1, d2 = k.generate(cfg), k.generate(cfg)
    assert all(np.array_equal(d1[key], d2[key]) for key in d1)
    assert d1["positions"].shape == (256, 64, 2, 2) and d1["positions"].dtype == np.float64
    assert d1["masses"].shape == (256, 2) and d1["force_mag"].shape == d1["r"].shape == (256, 64)
    n_orbits = cfg.n_steps * d1["dt"] / d1["period"]
    assert np.all((n_orbits >= 1.0) & (n_orbits <= 3.0))
    m1, m2 = d1["masses"].T
    assert np.all((m1 >= 0.5) & (m1 <= 2.0) & (m2 >= 0.1) & (m2 <= 1.0))
    assert np.allclose(d1["force_mag"], d1["G"] * (m1 * m2)[:, None] / d1["r"] ** 2)
    v = k.generate(k.preset("vafa", n_systems=64, n_steps=50))
    assert set(np.round(v["dt"], 12)) <= {round(7 / 365.25, 12), 0.5}
    assert np.isclose(v["G"], 4 * np.pi**2) and np.all(v["masses"][:, 1] <= 1e-2)


def test_bad_inputs_raise():
    one = np.ones(1)
    t = np.zeros((1, 3))
    ok = dict(m1=one, m2=one, a=one, e=0.5 * one, omega=0 * one, M0=0 * one, t=t)
    k.kepler_orbit(**ok)
    for key, val in (
        ("e", one),
        ("e", -0.1 * one),
        ("e", 1.5 * one),
        ("m1", 0 * one),
        ("m2", -one),
        ("a", 0 * one),
        ("a", np.nan * one),
    ):
        with pytest.raises(ValueError):
            k.kepler_orbit(**{**ok, key: val})
    for kw in (
        dict(e_max=1.0),
        dict(e_max=-0.1),
        dict(m1_range=(0.0, 1.0)),
        dict(a_range=(2.0, 1.0)),
        dict(G=0.0),
        dict(n_steps=2),
        dict(dt=-1.0),
    ):
        with pytest.raises(ValueError):
            k.preset("quick", **kw)
    with pytest.raises(ValueError, match="unknown preset"):
        k.preset("nope")
    with pytest.raises(ValueError):
        k.finite_difference_accel(np.zeros((2, 2, 2, 2)), 0.1)
    with pytest.raises(ValueError):
        k.finite_difference_accel(np.zeros((2, 5, 2, 2)), 0.0)
    with pytest.raises(ValueError):
        k.to_continuous(np.zeros((2, 5, 3, 2)))


def test_make_splits_idempotent_and_disjoint(tmp_path):
    cfg = k.preset("quick", n_systems=50, n_steps=16)
    man = k.make_splits(cfg, tmp_path)
    assert not man["reused"] and man["counts"] == {"train": 40, "probe": 5, "test": 5}
    idx = [k.load_split(tmp_path, s)["system_index"] for s in k.SPLITS]
    allidx = np.concatenate(idx)
    assert len(np.unique(allidx)) == 50 and set(allidx) == set(range(50))
    full = k.generate(cfg)
    test = k.load_split(tmp_path, "test")
    assert np.array_equal(test["positions"], full["positions"][idx[2]])
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["seed"] == cfg.seed and set(on_disk["sha256"]) == set(k.SPLITS)
    mtime = os.path.getmtime(tmp_path / "train.npz")
    again = k.make_splits(cfg, tmp_path)
    assert again["reused"] and os.path.getmtime(tmp_path / "train.npz") == mtime
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    (tmp_path / "probe.npz").write_bytes(b"corrupt")  # checksum mismatch -> regenerate
    assert not k.make_splits(cfg, tmp_path)["reused"]
    assert not k.make_splits(k.preset("quick", n_systems=50, n_steps=16, seed=1), tmp_path)[
        "reused"
    ]
    with pytest.raises(ValueError):
        k.make_splits(cfg, tmp_path, fractions=(0.5, 0.2, 0.2))


def test_continuous_tokens_roundtrip():
    d = k.generate(k.preset("quick", n_systems=8, n_steps=10))
    tok, scale = k.to_continuous(d["positions"])
    assert tok.shape == (8, 20, 2) and tok.dtype == np.float32
    assert np.max(np.abs(tok)) <= 1.0 and scale == pytest.approx(np.max(np.abs(d["positions"])))
    # per time step: the planet (body 1), then the star (body 0)
    assert np.allclose(tok[:, 0] * scale, d["positions"][:, 0, 1], rtol=1e-6)
    assert np.allclose(tok[:, 1] * scale, d["positions"][:, 0, 0], rtol=1e-6)
    back = k.from_continuous(tok, scale)
    assert np.max(np.abs(back - d["positions"])) < 1e-6 * scale


def test_discrete_tokens_quantisation_and_layout():
    d = k.generate(k.preset("quick", n_systems=8, n_steps=10))
    enc = k.to_discrete(d["positions"], d["dt"], n_bins=512)
    assert enc["coord_ids"].shape == (8, 21, 2) and enc["coord_ids"].dtype == np.int64
    assert enc["special_ids"].shape == (8, 21) and enc["special_ids"].dtype == np.int64
    assert np.all(enc["special_ids"][:, 0] >= 1) and np.all(enc["special_ids"][:, 1:] == 0)
    assert np.array_equal(enc["is_special"], enc["special_ids"] > 0)
    assert enc["coord_ids"].min() >= 0 and enc["coord_ids"].max() < 512
    assert enc["special_ids"].max() < enc["n_special"] and enc["n_clipped"] == 0
    pos, dt = k.from_discrete(enc)
    half = 0.5 * (enc["hi"] - enc["lo"]) / enc["n_bins"]
    assert np.max(np.abs(pos - d["positions"])) <= half * (1 + 1e-9)
    assert np.allclose(dt, d["dt"])  # 8 distinct dts <= n_dt_bins: exact
    binned = k.to_discrete(d["positions"], d["dt"], n_dt_bins=4)
    assert binned["n_special"] == 5 and np.all(
        np.abs(np.log(k.from_discrete(binned)[1] / d["dt"])) < 1
    )
    v = k.generate(k.preset("vafa", n_systems=16, n_steps=8))
    enc = k.to_discrete(v["positions"], v["dt"], 7000, -50.0, 50.0, dt_values=[7 / 365.25, 0.5])
    assert enc["n_special"] == 3 and np.allclose(k.from_discrete(enc)[1], v["dt"])
    with pytest.raises(ValueError):
        k.to_discrete(v["positions"], v["dt"], dt_values=[1.0])
    with pytest.raises(ValueError):
        k.to_discrete(v["positions"], v["dt"], lo=1.0, hi=0.0)
