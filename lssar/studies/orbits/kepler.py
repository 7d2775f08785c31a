"""Closed-form two-body Kepler orbits, dataset splits and token formats.

Conventions
-----------
* Body 0 is the star (mass ``m1``), body 1 the planet (mass ``m2``). Arrays of positions have
  shape ``(n_systems, n_steps, 2, 2)``: system, time step, body, (x, y).
* The relative orbit ``r = x2 - x1`` is a Kepler ellipse with semi-major axis ``a``,
  eccentricity ``e``, argument of periapsis ``omega`` and mean anomaly ``M0`` at ``t = 0``;
  mean motion ``n = sqrt(G (m1 + m2) / a**3)``. Bodies: ``x1 = X_cm - m2/(m1+m2) r`` and
  ``x2 = X_cm + m1/(m1+m2) r`` with ``X_cm(t) = X_cm0 + V_cm t``.
* Time sampling: step ``k`` is at ``t_k = k dt`` (uniform grid, one ``dt`` per system). ``dt``
  comes from, in order of precedence: ``OrbitConfig.dt`` (a fixed value, or a tuple of values
  drawn uniformly per system -- Vafa's one week / six months), ``steps_per_orbit``
  (``dt = period / steps_per_orbit``), or ``orbits_per_sequence`` (default: ``n_orbits ~
  U[1, 3]`` and ``dt = n_orbits * period / n_steps``, so every sequence shows 1-3 orbits).

Only the two-body problem is generated (Vafa et al. use 1-10 planets per star; the "vafa"
preset copies their distributions and time steps but keeps one planet).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from lssar.runio import atomic_write

__all__ = [
    "OrbitConfig",
    "PRESETS",
    "preset",
    "solve_kepler",
    "kepler_orbit",
    "generate",
    "make_splits",
    "load_split",
    "to_continuous",
    "from_continuous",
    "to_discrete",
    "from_discrete",
    "finite_difference_accel",
    "SPLITS",
]

SPLITS = ("train", "probe", "test")
FORMAT_VERSION = 1
YEAR_WEEK = 7.0 / 365.25


@dataclass
class OrbitConfig:
    """Distributions and sizes of a two-body dataset: masses log-uniform in ``m1_range`` /
    ``m2_range``; ``a`` log-uniform in ``a_range`` (uniform if ``a_uniform``); ``e`` uniform in
    ``[0, e_max]``, or Beta(``e_beta``) clipped to ``e_max``; ``omega``, ``M0`` uniform in
    ``[0, 2 pi)``; centre of mass uniform in ``[-com_pos_scale, com_pos_scale]^2`` (velocity
    likewise); orbit sense retrograde with probability ``p_retrograde``; time step: see the
    module docstring."""

    n_systems: int = 1024
    n_steps: int = 128
    dt: float | tuple[float, ...] | None = None
    steps_per_orbit: float | None = None
    orbits_per_sequence: tuple[float, float] = (1.0, 3.0)
    m1_range: tuple[float, float] = (0.5, 2.0)
    m2_range: tuple[float, float] = (0.1, 1.0)
    a_range: tuple[float, float] = (0.5, 2.0)
    a_uniform: bool = False
    e_max: float = 0.5
    e_beta: tuple[float, float] | None = None
    com_pos_scale: float = 1.0
    com_vel_scale: float = 0.0
    p_retrograde: float = 0.0
    G: float = 1.0
    seed: int = 0
    name: str = "custom"
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> OrbitConfig:
        """Raise ``ValueError`` on an inconsistent configuration; return ``self``."""
        if self.n_systems < 1 or self.n_steps < 3:
            raise ValueError("need n_systems >= 1 and n_steps >= 3")
        for nm in ("m1_range", "m2_range", "a_range", "orbits_per_sequence"):
            lo, hi = getattr(self, nm)
            if not (0 < lo <= hi):
                raise ValueError(f"{nm} must satisfy 0 < lo <= hi, got {(lo, hi)}")
        if not 0.0 <= self.e_max < 1.0:
            raise ValueError(f"e_max must be in [0, 1) (bound orbits), got {self.e_max}")
        if self.G <= 0:
            raise ValueError(f"G must be positive, got {self.G}")
        dts = np.atleast_1d(np.asarray(self.dt if self.dt is not None else 1.0, float))
        if np.any(dts <= 0) or (self.steps_per_orbit is not None and self.steps_per_orbit <= 0):
            raise ValueError("dt and steps_per_orbit must be positive")
        if self.com_pos_scale < 0 or self.com_vel_scale < 0 or not 0 <= self.p_retrograde <= 1:
            raise ValueError("com scales must be >= 0 and p_retrograde in [0, 1]")
        return self

    def to_json(self) -> dict[str, Any]:
        """JSON-normalised dict (tuples become lists), used in manifests."""
        return json.loads(json.dumps(asdict(self)))


PRESETS: dict[str, dict[str, Any]] = {
    # Comparable masses: both masses are identifiable from the motion of both bodies.
    "quick": dict(n_systems=256, n_steps=64, name="quick"),
    "cpu": dict(n_systems=4096, n_steps=128, name="cpu"),
    # Vafa et al. 2025: ~solar-mass star, exoplanet masses 1e-7..1e-2 M_sun (log-uniform here;
    # Vafa fit a gamma law), a uniform in 0.3..32 AU, Kipping Beta(0.867, 3.03) eccentricities,
    # dt = one week or six months, AU / M_sun / yr units (G = 4 pi^2); Vafa bin coordinates
    # over [-50, 50] AU ("extra"). Two-body only. With m2 << m1 the star barely moves, so m2
    # is hardly identifiable from the trajectory -- why the default presets use comparable masses.
    "vafa": dict(
        n_systems=4096,
        n_steps=500,
        dt=(YEAR_WEEK, 0.5),
        m1_range=(0.7, 1.5),
        m2_range=(1e-7, 1e-2),
        a_range=(0.3, 32.0),
        a_uniform=True,
        e_max=0.95,
        e_beta=(0.867, 3.03),
        com_pos_scale=0.0,
        G=4.0 * np.pi**2,
        name="vafa",
        extra={"coord_range": [-50.0, 50.0]},
    ),
}


def preset(name: str = "cpu", **overrides: Any) -> OrbitConfig:
    """Return the named preset (``"quick"``, ``"cpu"`` (default), ``"vafa"``) with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return replace(OrbitConfig(**PRESETS[name]), **overrides).validate()


def solve_kepler(
    M: np.ndarray, e: np.ndarray, tol: float = 1e-12, max_iter: int = 50
) -> np.ndarray:
    """Solve ``E - e sin E = M`` elementwise (Newton; Danby start ``M + 0.85 e sign(sin M)``).

    ``M`` and ``e`` broadcast; returns ``E`` with ``M`` reduced to ``[-pi, pi)`` first, so the
    result lies in ``[-pi, pi]``. Steps are clipped to ``[-1, 1]``; raises if not converged.
    """
    e = np.asarray(e, dtype=np.float64)
    if np.any(e < 0) or np.any(e >= 1):
        raise ValueError("eccentricity must satisfy 0 <= e < 1 (bound elliptic orbits)")
    M = np.mod(np.asarray(M, dtype=np.float64) + np.pi, 2 * np.pi) - np.pi
    M, e = np.broadcast_arrays(M, e)
    E = M + 0.85 * e * np.sign(np.sin(M))
    for _ in range(max_iter):
        step = np.clip((E - e * np.sin(E) - M) / (1.0 - e * np.cos(E)), -1.0, 1.0)
        E = E - step
        if np.max(np.abs(step), initial=0.0) < tol:
            return E
    raise RuntimeError("Kepler solver did not converge")


def _positive(name: str, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ValueError(f"{name} must be finite and positive")
    return x


def kepler_orbit(
    m1: np.ndarray,
    m2: np.ndarray,
    a: np.ndarray,
    e: np.ndarray,
    omega: np.ndarray,
    M0: np.ndarray,
    t: np.ndarray,
    G: float = 1.0,
    x_cm0: np.ndarray | None = None,
    v_cm: np.ndarray | None = None,
    sense: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Closed-form positions and velocities of ``S`` two-body systems on time grids ``t``.

    ``m1, m2, a, e, omega, M0``: ``(S,)``; ``t``: ``(S, T)``; ``x_cm0, v_cm``: ``(S, 2)``
    (default 0); ``sense``: ``(S,)`` of +1 (prograde) / -1. Returns ``positions`` and
    ``velocities`` ``(S, T, 2, 2)``, relative vector ``rel`` ``(S, T, 2)``, ``r`` ``(S, T)``,
    ``force_vec`` ``(S, T, 2, 2)`` (gravitational force on each body) and ``force_mag``
    ``(S, T)`` ``= G m1 m2 / r**2``, ``period`` ``(S,)``.
    """
    m1, m2, a = _positive("m1", m1), _positive("m2", m2), _positive("a", a)
    if G <= 0:
        raise ValueError("G must be positive")
    e = np.asarray(e, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)
    S = m1.shape[0]
    if t.ndim != 2 or t.shape[0] != S or any(np.shape(x) != (S,) for x in (m2, a, e, omega, M0)):
        raise ValueError("expected (S,) parameters and a (S, T) time grid")
    mtot = m1 + m2
    n = np.sqrt(G * mtot / a**3)
    E = solve_kepler(np.asarray(M0)[:, None] + n[:, None] * t, e[:, None])
    ee, aa, nn = e[:, None], a[:, None], n[:, None]
    b = aa * np.sqrt(1.0 - ee**2)
    s = np.ones(S) if sense is None else np.asarray(sense, dtype=np.float64)
    cos_e, sin_e = np.cos(E), np.sin(E)
    edot = nn / (1.0 - ee * cos_e)
    px, py = aa * (cos_e - ee), s[:, None] * b * sin_e
    vx, vy = -aa * sin_e * edot, s[:, None] * b * cos_e * edot
    co, so = np.cos(omega)[:, None], np.sin(omega)[:, None]
    rel = np.stack([co * px - so * py, so * px + co * py], axis=-1)
    vrel = np.stack([co * vx - so * vy, so * vx + co * vy], axis=-1)
    xc = np.zeros((S, 2)) if x_cm0 is None else np.asarray(x_cm0, dtype=np.float64)
    vc = np.zeros((S, 2)) if v_cm is None else np.asarray(v_cm, dtype=np.float64)
    com = xc[:, None, :] + vc[:, None, :] * t[..., None]
    f1, f2 = (m2 / mtot)[:, None, None], (m1 / mtot)[:, None, None]
    pos = np.stack([com - f1 * rel, com + f2 * rel], axis=2)
    vel = np.stack([vc[:, None, :] - f1 * vrel, vc[:, None, :] + f2 * vrel], axis=2)
    r = np.linalg.norm(rel, axis=-1)
    fmag = G * (m1 * m2)[:, None] / r**2
    f_on_planet = -fmag[..., None] * rel / r[..., None]
    return {
        "positions": pos,
        "velocities": vel,
        "rel": rel,
        "r": r,
        "force_mag": fmag,
        "force_vec": np.stack([-f_on_planet, f_on_planet], axis=2),
        "period": 2 * np.pi / n,
    }


def _log_uniform(rng: np.random.Generator, lo_hi: tuple[float, float], n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo_hi[0]), np.log(lo_hi[1]), n))


def generate(cfg: OrbitConfig) -> dict[str, np.ndarray]:
    """Sample ``cfg.n_systems`` systems and evaluate them on their time grids.

    Returns float64 arrays: ``positions``, ``velocities``, ``force_vec`` ``(S, T, 2, 2)``;
    ``r``, ``force_mag``, ``t`` ``(S, T)``; ``masses`` ``(S, 2)`` = (m1 star, m2 planet);
    ``a``, ``e``, ``omega``, ``M0``, ``period``, ``dt``, ``sense`` ``(S,)``; ``x_cm0``,
    ``v_cm`` ``(S, 2)``; ``G`` (scalar array). Deterministic in ``cfg.seed``.
    """
    cfg.validate()
    S, T = cfg.n_systems, cfg.n_steps
    rng = np.random.default_rng(cfg.seed)
    m1, m2 = _log_uniform(rng, cfg.m1_range, S), _log_uniform(rng, cfg.m2_range, S)
    a = rng.uniform(*cfg.a_range, S) if cfg.a_uniform else _log_uniform(rng, cfg.a_range, S)
    if cfg.e_beta is None:
        e = rng.uniform(0.0, cfg.e_max, S)
    else:
        e = np.minimum(rng.beta(cfg.e_beta[0], cfg.e_beta[1], S), cfg.e_max)
    omega, M0 = rng.uniform(0, 2 * np.pi, S), rng.uniform(0, 2 * np.pi, S)
    x_cm0 = rng.uniform(-cfg.com_pos_scale, cfg.com_pos_scale, (S, 2))
    v_cm = rng.uniform(-cfg.com_vel_scale, cfg.com_vel_scale, (S, 2))
    sense = np.where(rng.random(S) < cfg.p_retrograde, -1.0, 1.0)
    n_orbits = rng.uniform(*cfg.orbits_per_sequence, S)
    dt_choice = rng.integers(0, len(np.atleast_1d(cfg.dt if cfg.dt is not None else 1.0)), S)
    period = 2 * np.pi * np.sqrt(a**3 / (cfg.G * (m1 + m2)))
    if cfg.dt is not None:
        dt = np.atleast_1d(np.asarray(cfg.dt, dtype=np.float64))[dt_choice]
    elif cfg.steps_per_orbit is not None:
        dt = period / cfg.steps_per_orbit
    else:
        dt = n_orbits * period / T
    t = dt[:, None] * np.arange(T)[None, :]
    orb = kepler_orbit(m1, m2, a, e, omega, M0, t, cfg.G, x_cm0, v_cm, sense)
    out = {k: orb[k] for k in ("positions", "velocities", "force_vec", "r", "force_mag")}
    out.update(
        t=t,
        masses=np.stack([m1, m2], 1),
        a=a,
        e=e,
        omega=omega,
        M0=M0,
        period=period,
        dt=dt,
        sense=sense,
        x_cm0=x_cm0,
        v_cm=v_cm,
        G=np.asarray(cfg.G),
    )
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_splits(
    cfg: OrbitConfig,
    out_dir: str | os.PathLike,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
) -> dict[str, Any]:
    """Generate ``cfg.n_systems`` systems, split them into disjoint train / probe / test sets
    (seeded permutation) and save ``{split}.npz`` plus ``manifest.json`` in ``out_dir``.

    Writes are atomic (temp file + ``os.replace``; the manifest last). Idempotent: when a
    manifest with the same config, fractions and format exists and every file matches its
    sha256, nothing is regenerated. Returns the manifest (``"reused"`` says which case).
    """
    cfg.validate()
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.shape != (3,) or np.any(fr < 0) or not np.isclose(fr.sum(), 1.0):
        raise ValueError("fractions must be three non-negative numbers summing to 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    man_path = out / "manifest.json"
    key = {"format_version": FORMAT_VERSION, "config": cfg.to_json(), "fractions": fr.tolist()}
    if man_path.exists():
        try:
            old = json.loads(man_path.read_text())
            if all(old.get(k) == v for k, v in key.items()) and all(
                (out / f"{s}.npz").exists() and _sha256(out / f"{s}.npz") == old["sha256"][s]
                for s in SPLITS
            ):
                return {**old, "reused": True}
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or stale manifest: regenerate
    data = generate(cfg)
    S = cfg.n_systems
    counts = np.floor(fr * S).astype(int)
    counts[0] += S - counts.sum()
    perm = np.random.default_rng([cfg.seed, 1]).permutation(S)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    checks: dict[str, str] = {}
    for i, split in enumerate(SPLITS):
        idx = np.sort(perm[bounds[i] : bounds[i + 1]])
        arrays = {k: (v if v.ndim == 0 else v[idx]) for k, v in data.items()}
        arrays["system_index"] = idx
        atomic_write(out / f"{split}.npz", lambda f, arr=arrays: np.savez(f, **arr))
        checks[split] = _sha256(out / f"{split}.npz")
    manifest = {
        **key,
        "seed": cfg.seed,
        "counts": dict(zip(SPLITS, counts.tolist(), strict=True)),
        "sha256": checks,
    }
    atomic_write(man_path, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    return {**manifest, "reused": False}


def load_split(out_dir: str | os.PathLike, split: str) -> dict[str, np.ndarray]:
    """Load one split written by :func:`make_splits` as a dict of arrays."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    with np.load(Path(out_dir) / f"{split}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _check_positions(positions: np.ndarray) -> np.ndarray:
    p = np.asarray(positions, dtype=np.float64)
    if p.ndim != 4 or p.shape[2:] != (2, 2):
        raise ValueError(f"positions must have shape (S, T, 2, 2), got {p.shape}")
    return p


def to_continuous(positions: np.ndarray, scale: float | None = None) -> tuple[np.ndarray, float]:
    """Continuous tokens ``(S, 2T, 2)`` float32: per time step the planet then the star.

    Coordinates are divided by ``scale``; by default the dataset's largest absolute coordinate,
    so tokens lie in ``[-1, 1]``. Pass the train split's scale when encoding probe / test.
    """
    p = _check_positions(positions)
    if scale is None:
        scale = float(np.max(np.abs(p))) or 1.0
    if not scale > 0:
        raise ValueError("scale must be positive")
    S, T = p.shape[:2]
    return (p[:, :, ::-1, :].reshape(S, 2 * T, 2) / scale).astype(np.float32), float(scale)


def from_continuous(tokens: np.ndarray, scale: float) -> np.ndarray:
    """Inverse of :func:`to_continuous`: ``(S, 2T, 2)`` -> positions ``(S, T, 2, 2)``."""
    tk = np.asarray(tokens, dtype=np.float64)
    if tk.ndim != 3 or tk.shape[1] % 2 or tk.shape[2] != 2:
        raise ValueError(f"tokens must have shape (S, 2T, 2), got {tk.shape}")
    return tk.reshape(tk.shape[0], -1, 2, 2)[:, :, ::-1, :] * scale


def to_discrete(
    positions: np.ndarray,
    dt: np.ndarray,
    n_bins: int = 512,
    lo: float | None = None,
    hi: float | None = None,
    dt_values: np.ndarray | None = None,
    n_dt_bins: int = 16,
) -> dict[str, Any]:
    """Vafa-style discretised tokens for two embedding tables.

    Layout (length ``L = 1 + 2T``): position 0 is the dt token, then per time step the planet
    token and the star token (as in :func:`to_continuous`). Returns:

    * ``coord_ids`` ``(S, L, 2)`` int64: (x_bin, y_bin) in ``[0, n_bins)`` (uniform bins over
      ``[lo, hi]``, values outside are clipped; ``n_clipped`` counts them); 0 at position 0.
    * ``special_ids`` ``(S, L)`` int64 into the special table of size ``n_special``: 0 = "not
      special" (coordinate positions), ``1 + j`` = dt token for ``dt_values[j]``.
    * ``is_special`` ``(S, L)`` bool; ``lo``, ``hi``, ``n_bins``, ``dt_values``, ``n_special``.

    ``lo``/``hi`` default to ``-/+`` the largest absolute coordinate. dt tokens: the given
    ``dt_values`` (each ``dt`` must match one to 1e-6 relative), else the distinct dts when at
    most ``n_dt_bins``, else ``n_dt_bins`` log-uniform bins (``dt_values`` = geometric centres).
    """
    p = _check_positions(positions)
    S, T = p.shape[:2]
    dt = _positive("dt", np.broadcast_to(np.asarray(dt, dtype=np.float64), (S,)))
    if n_bins < 2:
        raise ValueError("n_bins must be >= 2")
    amax = float(np.max(np.abs(p))) or 1.0
    lo = -amax if lo is None else float(lo)
    hi = amax if hi is None else float(hi)
    if not hi > lo:
        raise ValueError("need hi > lo")
    width = (hi - lo) / n_bins
    seq = p[:, :, ::-1, :].reshape(S, 2 * T, 2)
    raw = np.floor((seq - lo) / width)
    ids = np.clip(raw, 0, n_bins - 1).astype(np.int64)
    if dt_values is not None:
        dtv = _positive("dt_values", np.atleast_1d(dt_values))
        j = np.argmin(np.abs(np.log(dt[:, None]) - np.log(dtv[None, :])), axis=1)
        if np.any(np.abs(dtv[j] / dt - 1) > 1e-6):
            raise ValueError("some dt do not match any of dt_values")
    elif np.unique(dt).size <= n_dt_bins:
        dtv, j = np.unique(dt, return_inverse=True)
    else:
        edges = np.linspace(np.log(dt.min()), np.log(dt.max()), n_dt_bins + 1)
        j = np.clip(np.searchsorted(edges, np.log(dt), side="right") - 1, 0, n_dt_bins - 1)
        dtv = np.exp(0.5 * (edges[1:] + edges[:-1]))
    coord_ids = np.zeros((S, 1 + 2 * T, 2), dtype=np.int64)
    coord_ids[:, 1:] = ids
    special_ids = np.zeros((S, 1 + 2 * T), dtype=np.int64)
    special_ids[:, 0] = 1 + np.asarray(j).reshape(S)
    return {
        "coord_ids": coord_ids,
        "special_ids": special_ids,
        "is_special": special_ids > 0,
        "lo": lo,
        "hi": hi,
        "n_bins": int(n_bins),
        "dt_values": np.asarray(dtv, np.float64),
        "n_special": 1 + len(dtv),
        "n_clipped": int(np.sum((raw < 0) | (raw > n_bins - 1))),
    }


def from_discrete(enc: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Decode :func:`to_discrete` output to bin-centre positions ``(S, T, 2, 2)`` and ``dt``
    ``(S,)``; inside ``[lo, hi]`` the error is at most half a bin width per coordinate."""
    ids = np.asarray(enc["coord_ids"])[:, 1:]
    width = (enc["hi"] - enc["lo"]) / enc["n_bins"]
    seq = enc["lo"] + (ids + 0.5) * width
    S = ids.shape[0]
    pos = seq.reshape(S, -1, 2, 2)[:, :, ::-1, :]
    return pos, np.asarray(enc["dt_values"])[np.asarray(enc["special_ids"])[:, 0] - 1]


def finite_difference_accel(positions: np.ndarray, dt: float | np.ndarray) -> np.ndarray:
    """Second-order central differences ``(x[k+1] - 2 x[k] + x[k-1]) / dt**2``.

    ``positions``: ``(S, T, ...)`` (e.g. ``(S, T, 2, 2)``); ``dt``: scalar or ``(S,)``.
    Returns ``(S, T - 2, ...)``: the accelerations at interior steps ``1 .. T-2``.
    """
    x = np.asarray(positions, dtype=np.float64)
    if x.ndim < 2 or x.shape[1] < 3:
        raise ValueError("need positions of shape (S, T, ...) with T >= 3")
    d = np.asarray(dt, dtype=np.float64)
    d = _positive("dt", d.reshape((-1,) + (1,) * (x.ndim - 1)) if d.ndim else d)
    return (x[:, 2:] - 2.0 * x[:, 1:-1] + x[:, :-2]) / d**2
