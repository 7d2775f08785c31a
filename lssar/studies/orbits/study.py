"""``lssar orbits``: does a trajectory GPT's force probe recover Newton's law? (paper v5)

Setup after Vafa et al. (2025): a GPT is pretrained to predict the next position on two-body
trajectories; a force head is then fine-tuned (whole model) on other systems to predict
``log |F|`` at every step; its predictions on held-out systems go to symbolic regression, which
should return ``F = G m1 m2 / r**2``. The paper reports that LSSAR does and softmax does not.

Every arm of a preset sees identical data, seed, model size and step budget; only the
attention differs (``torch.manual_seed(seed)`` before each model is built, and the batch order
is a function of the seed). Arms: :data:`ARMS` -- the attention variants, a softmax with a
sliding window (locality control: does sharper attention alone explain a win?), a model
fine-tuned without pretraining, the ideal estimator (a softmax model told the true masses), and
the oracle (symbolic regression on the true forces). Every model arm's symbolic regression is
also run on its noise ceiling (:mod:`.ceiling`: the true forces seen through that arm's measured
probe noise), which is what the report judges the arm's exponents against.

Every stage (pretraining, force probe, symbolic regression) of every arm and seed is cached in
``runs/orbits-<preset>/<arm>-s<seed>/`` (the dataset in ``runs/orbits-<preset>/data/``) under a
hash of everything it depends on (settings, data, and a digest of the code that computes it),
written atomically by one process at a time (a lock), so re-running reuses finished work,
resumes after a kill at the last finished stage and recomputes only what a change of settings
invalidates (:mod:`.cache`). The report (``reports/orbits-<preset>-<date>/``) is generated from
those files (:mod:`.report`).

This module is the runner; the arms, presets and ``--set`` parser live in :mod:`.presets` (and
are importable from here), the networks and training loops in :mod:`.models`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lssar import clihelp
from lssar.runio import environment, exclusive_lock
from lssar.studies.common import Study, code_digest, study_args, study_parser
from lssar.studies.orbits import kepler, symreg
from lssar.studies.orbits.cache import key_of, load_if, save_json, save_npz, save_torch
from lssar.studies.orbits.ceiling import exponent_errors, noise_ceiling
from lssar.studies.orbits.models import (
    FORMATS,
    Data,
    OrbitGPT,
    OrbitModelConfig,
    encode_splits,
    extrapolation_baselines,
    force_probes,
    next_token_eval,
    pretrain,
)
from lssar.studies.orbits.presets import (
    ARMS,
    DATA_HELP,
    PRESETS,
    SET_HELP,
    SET_SKIP,
    Arm,
    Preset,
    check_arms,
    parse_set,
    resolve_preset,
)
from lssar.train.checkpoint import CONFIG, ENV, open_run

__all__ = [  # the settings live in .presets; imported from here as before
    "ARMS",
    "PRESETS",
    "Arm",
    "OrbitsStudy",
    "Preset",
    "Runner",
    "check_arms",
    "cli",
    "model_config",
    "parse_set",
    "prepare_data",
    "resolve_preset",
    "run_study",
    "sr_points",
    "symbolic_regression",
]


# what every stage's result depends on besides its settings: a change here recomputes it
_CODE = (
    "studies/orbits/models.py",
    "studies/orbits/symreg.py",
    "studies/orbits/ceiling.py",
    "train/schedule.py",
    "model.py",
    "spec.py",
    "ops",
)


# ------------------------------------------------------------------------------- data
def prepare_data(p: Preset, ddir: Path, device: torch.device) -> Data:
    """Generate (or reuse) the dataset ``ddir`` and encode it in ``p.fmt``."""
    cfg = kepler.preset(p.data_preset, **p.data)  # kepler validates the orbital parameters
    with exclusive_lock(ddir, "orbits dataset", wait=True):  # one writer; the rest reuse it
        manifest = kepler.make_splits(cfg, ddir, p.fractions)
    raw = {s: kepler.load_split(ddir, s) for s in kepler.SPLITS}
    data = encode_splits(raw, p.fmt, p.n_bins, cfg.extra.get("coord_range"), device)
    data.key = key_of({"sha256": manifest["sha256"], "fmt": p.fmt, "n_bins": p.n_bins})
    data.info.update(config=cfg.to_json(), counts=manifest["counts"])
    return data


# ------------------------------------------------------------------------------- one run
def model_config(p: Preset, arm: Arm, data: Data) -> OrbitModelConfig:
    return OrbitModelConfig(
        n_layer=p.n_layer,
        n_head=p.n_head,
        n_embd=p.n_embd,
        attn=arm.attention.name if arm.attention else "softmax",
        attn_options=dict(arm.attention.options) if arm.attention else {},
        window=p.window if arm.window else None,
        fmt=p.fmt,
        n_bins=p.n_bins,
        n_special=data.n_special,
        accel_scale=data.accel_scale,
        sees_masses=arm.sees_masses,
    )


def sr_points(data: Data, p: Preset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The (system, step) test points handed to symbolic regression: the same for every arm
    of a seed. Steps count from 0 (``>= p.first_step``)."""
    S, T = data.log_f["test"].shape
    K = T - p.first_step
    flat = np.random.default_rng([seed, 2025]).choice(S * K, min(p.sr_points, S * K), replace=False)
    return flat // K, flat % K + p.first_step


def symbolic_regression(
    m1: np.ndarray, m2: np.ndarray, r: np.ndarray, F: np.ndarray, p: Preset, seed: int, backend: str
) -> dict[str, Any]:
    """Power law (+ bootstrap) and its exponent errors, sparse law search and GP symbolic
    regression of ``F``."""
    t0 = time.perf_counter()
    pl = symreg.power_law_fit(m1, m2, r, F, n_boot=p.n_boot, seed=seed)
    sparse = symreg.sparse_law_search(m1, m2, r, F, seed=seed, tol=p.tol)
    try:
        gp = symreg.gp_symbolic_regression(
            m1, m2, r, F, backend=backend, seed=seed, time_budget_s=p.sr_budget_s, tol=p.tol
        )
        gp.pop("sympy")
    except RuntimeError as e:  # every GP candidate degenerate: a failed recovery, not a crash
        nan = float("nan")
        gp = {
            "backend": backend,
            "expression": f"(none: {e})",
            "is_newton": False,
            "r2": nan,
            "newton_G": None,
            "alpha": nan,
            "beta": nan,
            "gamma": nan,
        }
    return {
        "n_points": len(F),
        "power_law": pl,
        "errors": exponent_errors(pl),
        "sparse": {k: sparse[k] for k in ("law", "agree", "is_newton")}
        | {"exponents": sparse["full"]["exponents"] if sparse["full"] else None},
        "gp": gp,
        "seconds": time.perf_counter() - t0,
    }


class Runner:
    """Runs (or reuses) arm/seed runs of one preset in ``runs/<arm>-s<seed>/``, on the dataset
    ``runs/data/``."""

    def __init__(
        self, p: Preset, runs: Path, backend: str, device: torch.device, progress: bool
    ) -> None:
        self.p, self.runs, self.backend = p, runs, backend
        self.device, self.progress = device, progress
        self.data = prepare_data(p, runs / "data", device)
        self.computed: list[str] = []  # stages computed (not reused) by this invocation

    def run(self, arm: Arm, seed: int) -> dict[str, Any]:
        d = self.runs / f"{arm.name}-s{seed}"
        # two invocations on one --runs: one works here; a stage write that was killed is
        # removed. No config check: another setting recomputes the stages it changes
        with open_run(d, what="orbits run"):
            return self._run(arm, seed, d)

    def _run(self, arm: Arm, seed: int, d: Path) -> dict[str, Any]:
        p, data = self.p, self.data
        idx_s, idx_t = sr_points(data, p, seed)
        masses, r = data.masses["test"][idx_s], data.r["test"][idx_s, idx_t]
        sr_cfg = {
            k: getattr(p, k)
            for k in ("sr_points", "sr_budget_s", "n_boot", "tol", "ceiling_draws", "first_step")
        }
        if arm.attention is None:  # oracle: the true forces through the same pipeline
            key = key_of(
                {"data": data.key, "sr": sr_cfg, "backend": self.backend, "seed": seed}
                | {"code": code_digest(_CODE)}
            )
            res = load_if(d / "result.json", key)
            if res is None:
                F = np.exp(data.log_f["test"][idx_s, idx_t])
                res = {
                    "key": key,
                    "arm": arm.name,
                    "seed": seed,
                    "pretrain": None,
                    "probe": None,
                    "sr": symbolic_regression(
                        masses[:, 0], masses[:, 1], r, F, p, seed, self.backend
                    ),
                    "ceiling": None,  # no probe, no noise: the oracle is its own ceiling
                    "within_ceiling": None,
                }
                self._finish(d, res, arm)
            return res | {"run_dir": str(d)}
        mcfg = model_config(p, arm, data)
        k1 = key_of(
            {
                "data": data.key,
                "model": mcfg.to_json(),
                "seed": seed,
                "code": code_digest(_CODE),  # other training or probe code: recomputed
                "pretrain": [p.pretrain_steps, p.pretrain_batch, p.pretrain_lr]
                if arm.pretrained
                else None,
            }
        )
        k2 = key_of(
            {
                "k1": k1,
                "finetune": [p.finetune_steps, p.finetune_batch, p.finetune_lr],
                "first_step": p.first_step,
                "ridge_alpha": p.ridge_alpha,
            }
        )
        k3 = key_of({"k2": k2, "sr": sr_cfg, "backend": self.backend})
        res = load_if(d / "result.json", k3)
        if res is not None:
            return res | {"run_dir": str(d)}
        pred = load_if(d / "predictions.npz", k2)
        if pred is None:
            pre, pred = self._train(arm, seed, mcfg, d, k1, k2)
        else:
            pre = load_if(d / "pretrained.pt", k1)
        idx_k = idx_t - p.first_step
        F_hat = np.exp(pred["log_f_pred"][idx_s, idx_k])
        sr = symbolic_regression(masses[:, 0], masses[:, 1], r, F_hat, p, seed, self.backend)
        ridge_f = np.exp(pred["log_f_ridge"][idx_s, idx_k])
        ridge = symreg.power_law_fit(
            masses[:, 0], masses[:, 1], r, ridge_f, n_boot=p.n_boot, seed=seed
        )
        sr["ridge_power_law"] = ridge | {"errors": exponent_errors(ridge)}
        log_f = data.log_f["test"][idx_s, idx_t]
        ceil = noise_ceiling(
            masses[:, 0],
            masses[:, 1],
            r,
            log_f,
            pred["log_f_pred"] - pred["log_f_true"],  # the probe's residuals, all test points
            idx_s,
            idx_k,
            p.ceiling_draws,
            seed,
        )
        noisy = np.exp(log_f + ceil.pop("noise0"))  # one draw through the whole SR pipeline
        ceil["sr"] = symbolic_regression(
            masses[:, 0], masses[:, 1], r, noisy, p, seed, self.backend
        )
        res = {
            "key": k3,
            "arm": arm.name,
            "seed": seed,
            "attn": mcfg.attn,
            "attn_options": mcfg.attn_options,
            "window": mcfg.window,
            "pretrained": arm.pretrained,
            "params": int(pred["params"]),
            "pretrain": None
            if pre is None
            else {k: pre[k] for k in pre if k not in ("key", "state", "curve")},
            "probe": {
                k: float(pred[k])
                for k in (
                    "test_r2",
                    "test_rmse",
                    "probe_r2",
                    "ridge_test_r2",
                    "ridge_probe_r2",
                    "seconds",
                )
            },
            "sr": sr,
            "ceiling": ceil,
            "within_ceiling": sr["errors"]["max_err"] <= ceil["max_err_q95"],
        }
        self._finish(d, res, arm)
        return res | {"run_dir": str(d)}

    def _finish(self, d: Path, res: dict[str, Any], arm: Arm) -> None:
        res["env"] = environment(self.device, sr_backends=symreg.installed_backends())
        save_json(d / "result.json", res)
        self.computed.append(f"{arm.name}-s{res['seed']}:sr")

    def _train(
        self, arm: Arm, seed: int, mcfg: OrbitModelConfig, d: Path, k1: str, k2: str
    ) -> tuple[dict | None, dict]:
        p, data = self.p, self.data
        torch.manual_seed(seed)
        model = OrbitGPT(mcfg).to(self.device)
        save_json(
            d / CONFIG,
            {
                "preset": dataclasses.asdict(p),
                "arm": arm.name,
                "seed": seed,
                "model": mcfg.to_json(),
                "data": data.info,
            },
        )
        save_json(d / ENV, environment(self.device, sr_backends=symreg.installed_backends()))
        pre = None
        if arm.pretrained:
            pre = load_if(d / "pretrained.pt", k1)
            if pre is None:
                t0 = time.perf_counter()
                curve = pretrain(
                    model,
                    data.tokens["train"],
                    p.pretrain_steps,
                    p.pretrain_batch,
                    p.pretrain_lr,
                    seed * 1000 + 1,
                    self.progress,
                )
                skip = 7  # from step 3 on, where the extrapolation baselines are defined
                pre = {
                    "key": k1,
                    "state": model.state_dict(),
                    "curve": curve,
                    "test_loss": next_token_eval(model, data.tokens["test"], skip),
                    "final_train_loss": float(np.mean(curve[-20:])),
                    "loss": "mse" if p.fmt == "continuous" else "cross-entropy (x + y bins)",
                    "seconds": time.perf_counter() - t0,
                    "steps": p.pretrain_steps,
                }
                if p.fmt == "continuous":
                    x = data.tokens["test"]["x"].cpu().numpy()
                    pre["baselines"] = extrapolation_baselines(x, skip, data.accel_scale)
                save_torch(d / "pretrained.pt", pre)
                self.computed.append(f"{arm.name}-s{seed}:pretrain")
            else:
                model.load_state_dict(pre["state"])
            pre = {k: v for k, v in pre.items() if k != "state"}
        pred = force_probes(
            model,
            data,
            p.first_step,
            p.ridge_alpha,
            p.finetune_steps,
            p.finetune_batch,
            p.finetune_lr,
            seed * 1000 + 2,
            self.progress,
        )
        save_torch(d / "finetuned.pt", {"key": k2, "state": model.state_dict()})
        pred["key"] = k2
        save_npz(d / "predictions.npz", **pred)
        self.computed.append(f"{arm.name}-s{seed}:probe")
        return pre, pred


# ------------------------------------------------------------------------------- entry
@dataclass
class OrbitsStudy(Study):
    """``lssar orbits``: one unit per (arm, seed), seeds outermost, each run by this process's
    :class:`Runner` (a worker makes its own on the dataset the main process prepared); the report
    (:mod:`.report`) gets every run's result and the stages computed now."""

    name: str
    p: Preset
    arms: list[str]
    seeds: list[int]
    runs: Path
    out: Path
    backend: str
    device: str
    progress: bool  # inside a unit: bars per stage (one unit at a time only)
    _runner: Runner | None = field(default=None, repr=False)

    def __getstate__(self) -> dict[str, Any]:  # a worker builds its own runner
        return self.__dict__ | {"_runner": None}

    def runner(self) -> Runner:
        if self._runner is None:
            device = torch.device(self.device)
            self._runner = Runner(self.p, self.runs, self.backend, device, self.progress)
        return self._runner

    def units(self) -> list[tuple[Any, ...]]:
        return [(a, s) for s in self.seeds for a in self.arms]

    def run_unit(self, arm: str, seed: int) -> tuple[dict[str, Any], list[str]]:
        """One arm/seed's result and the stages computed for it now."""
        runner = self.runner()
        start = len(runner.computed)
        return runner.run(ARMS[arm], seed), runner.computed[start:]

    def write_report(self, results: list[Any], seconds: float) -> Path:
        from lssar.studies.orbits.report import write_report

        return write_report(
            self.name,
            self.p,
            [res for res, _ in results],
            self.out,
            seconds,
            self.runner().data.info,
            environment(self.device, sr_backends=symreg.installed_backends()),
            [c for _, computed in results for c in computed],
        )


def run_study(
    preset: str = "quick",
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    runs: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    overrides: dict[str, Any] | None = None,
    fmt: str | None = None,
    backend: str = "auto",
    progress: bool = True,
    jobs: int | None = None,
) -> dict[str, Any]:
    """Run (or reuse) every arm x seed of ``preset`` in ``runs`` (default
    ``runs/orbits-<preset>``, the dataset in its ``data/``) and write the report to ``out``
    (default ``reports/orbits-<preset>-<date>``).

    ``jobs`` (default: the preset's) runs that many arm/seed runs at once in worker processes
    with one torch thread each; results do not depend on it. Returns ``{"report": Path,
    "results": [...], "computed": [stages computed now], "seconds": float}``."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    p = resolve_preset(preset, overrides, fmt)
    arms = check_arms(arms if arms is not None else p.arms)
    seeds = list(seeds if seeds is not None else p.seeds)
    if not seeds:
        raise ValueError("need at least one seed")
    jobs = p.jobs if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    backend = symreg._resolve_backend(backend)  # fail before training if SR cannot run
    device = ("cuda" if torch.cuda.is_available() else "cpu") if p.device == "auto" else p.device
    runs = Path(runs or f"runs/orbits-{preset}")
    out = Path(out or f"reports/orbits-{preset}-{dt.date.today().isoformat()}")
    study = OrbitsStudy(preset, p, arms, seeds, runs, out, backend, device, progress and jobs == 1)
    study.runner()  # makes the data, once, before any worker
    bar = tqdm(
        total=len(study.units()), desc=f"orbits {preset}", disable=not progress, dynamic_ncols=True
    )
    done = study.run(jobs, lambda i, r: bar.update())
    bar.close()
    return {
        "report": done.report,
        "results": [res for res, _ in done.results],
        "computed": [c for _, computed in done.results for c in computed],
        "seconds": time.perf_counter() - t0,
    }


def parser() -> argparse.ArgumentParser:
    """``lssar orbits``'s options and ``--set`` keys, each described (``lssar orbits --help``)."""
    quick = PRESETS["quick"]
    keys = clihelp.keys_help(
        Preset, SET_HELP, quick, {"fmt": list(FORMATS)}, "{key}={value}", skip=SET_SKIP
    )
    data = clihelp.keys_help(
        kepler.OrbitConfig,
        DATA_HELP,
        kepler.preset(quick.data_preset, **quick.data),
        form="{key}={value}",
        prefix="data.",
    )
    ap = study_parser(
        "lssar orbits",
        __doc__,
        PRESETS,
        ARMS,
        runs="runs/orbits-PRESET",
        out="reports/orbits-PRESET-DATE",
    )
    ap.epilog += (
        "\n\nsettings for --set KEY=VALUE (defaults of the quick preset; tuples as Python "
        f"literals):\n{keys}\n{data}"
    )
    ap.add_argument("--format", choices=FORMATS, help="token format; none: the preset's (data fmt)")
    ap.add_argument(
        "--sr-backend",
        default="auto",
        choices=["auto", *symreg.BACKENDS],
        help="symbolic regression package (auto: the first installed)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: these matrices are tiny, and one thread does not collapse "
        "when the cores are shared)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a preset field (listed below), e.g. pretrain_steps=100, data.n_systems=500",
    )
    return ap


def cli(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    arms, seeds = study_args(args)
    if args.out is not None and args.runs is None:
        print(
            "note: --out is the report directory, as in the other studies (it was the root of "
            f"data/, runs/ and reports/); the runs go to runs/orbits-{args.preset} (--runs)",
            file=sys.stderr,
        )
    overrides = parse_set(args.set)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        out = run_study(
            args.preset,
            arms,
            seeds,
            args.runs,
            args.out,
            overrides,
            args.format,
            args.sr_backend,
            not args.no_progress,
            args.jobs,
        )
    except ImportError as e:  # a missing SR backend: one line naming what to install
        raise ValueError(str(e)) from e
    print(f"report: {out['report'] / 'REPORT.md'} ({out['seconds'] / 60:.1f} min)")
    return 0
