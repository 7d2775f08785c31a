"""The report of ``lssar orbits``: REPORT.md, results.json and plots, generated from the run
directories' results (never typed by hand). The verdicts and every sentence about a finding come
from :mod:`.judging`; the figures from :mod:`.plots`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from lssar.studies.common import environment_section, provenance_head
from lssar.studies.common import write_report as write_files
from lssar.studies.orbits.ceiling import ERRORS, EXPONENTS, TARGET
from lssar.studies.orbits.judging import (
    arm_intervals,
    by_seed,
    claim,
    exploratory,
    fmt_iv,
)
from lssar.studies.orbits.plots import write_plots
from lssar.studies.stats import Interval, mean_ci

CONTROLS = {
    "lssa": "LSSA (no re-weighting)",
    "lssar-p3": "LSSAR p = 3",
    "softmax-local": "the locality control (softmax, sliding window)",
    "scratch": "the no-pretraining control",
    "softmax-masses": "the ideal estimator (softmax told the true masses)",
}


def _shas(results: list[dict[str, Any]]) -> set[str]:
    return {str(r.get("env", {}).get("git_sha"))[:10] for r in results}


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None or not np.isfinite(x) else format(x, fmt)


def _ms(xs: list[float], fmt: str = ".3f") -> str:
    """mean ± sd over seeds (just the value for one seed)."""
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    if not xs:
        return "–"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{np.mean(xs):{fmt}} ± {np.std(xs, ddof=1):{fmt}}"


def _yn(b: bool | None) -> str:
    return "–" if b is None else ("yes" if b else "no")


def _compute(results: list[dict[str, Any]]) -> str:
    """Summed stage times of the runs (whether computed now or reused)."""
    parts = {
        "pretraining": sum(r["pretrain"]["seconds"] for r in results if r["pretrain"]),
        "force probes": sum(r["probe"]["seconds"] for r in results if r["probe"]),
        "symbolic regression (incl. ceilings)": sum(
            r["sr"].get("seconds", 0.0) + (r["ceiling"]["sr"]["seconds"] if r["ceiling"] else 0)
            for r in results
        ),
    }
    total = sum(parts.values())
    return (
        f"{total / 60:.1f} min (" + ", ".join(f"{k} {v / 60:.1f}" for k, v in parts.items()) + ")"
    )


def _controls(results: list[dict[str, Any]], explore: dict[str, Any], tol: float) -> list[str]:
    """One generated line per control arm (its label against its ceiling) and the oracle."""
    arms = by_seed(results)
    lines = []
    for arm, what in CONTROLS.items():
        if arm in explore:
            iv = arm_intervals(arms[arm])
            lines.append(
                f"- {what}: largest exponent error {fmt_iv(iv['max_err'])}, its ceiling's "
                f"{fmt_iv(iv['ceiling_max_err'])}; {explore[arm]['ceiling']['text']}."
            )
    runs = [r for r in results if r.get("ceiling")]
    if runs:  # the GP's fixed band, calibrated the same way: can it pass on the exact law + noise?
        on_ceiling = sum(bool(r["ceiling"]["sr"]["gp"]["is_newton"]) for r in runs)
        on_pred = sum(bool(r["sr"]["gp"]["is_newton"]) for r in runs)
        lines.append(
            f"- The GP's formula has Newton's form (local exponents within {tol:g} of (1, 1, −2)) "
            f"on one draw of the noise ceiling — the exact law seen through the probe's noise — "
            f"in {on_ceiling}/{len(runs)} model runs, and on the predicted forces in "
            f"{on_pred}/{len(runs)}."
        )
    if "oracle" in arms:
        rs = list(arms["oracle"].values())
        ok = all(r["sr"]["gp"]["newton_G"] is not None for r in rs)
        lines.append(
            f"- Sanity check: on the true forces the pipeline returns "
            f"`F = {rs[0]['sr']['gp']['expression']}` "
            f"({'exactly' if ok else 'NOT exactly'} C·m1·m2/r² in {len(rs)} seed(s))."
        )
    return lines


def _method(p: Any) -> list[str]:
    return [
        "## The Newton criterion",
        "",
        "Each run's measure is the **largest exponent error** max(|α−1|, |β−1|, |γ+2|) of the "
        "power law log F̂ = log C + α log m1 + β log m2 + γ log r fitted to its predicted forces "
        "on the symbolic-regression points. A force probe is never exact, and a fixed "
        "threshold (formerly |error| ≤ 0.1 with R² ≥ 0.95) asks for more than an imperfect "
        "probe of the exact law could give. So every run is judged against its **noise "
        "ceiling**: the true log F on the same points plus the probe's own residuals "
        "log F̂ − log F, drawn by permuting the test systems (each point gets the residual the "
        f"probe made at the same step of another system; {p.ceiling_draws} draws), fitted by "
        "the same power law. The permutation keeps the noise's size, shape, step profile and "
        "its correlation within a system, and removes only its dependence on the point's own "
        "(m1, m2, r) — which is what a law other than Newton's would leave. The ceiling is what "
        "an estimator with this much error and the exact law gets; one of its draws is also "
        "run through the sparse search and the GP.",
        "",
        "An arm **recovers Newton's form** when its largest exponent error is as close to 0 "
        f"as its ceiling's: the paired (by seed) difference is equivalent to 0 within "
        f"±{p.margin:g} (TOST, 90% interval); it is **further than its ceiling** when the 95% "
        "t interval of the difference lies above 0; otherwise it is not separable from its "
        "ceiling at this power. The paper's claim is judged from LSSAR's and softmax's "
        "comparisons with their ceilings and with each other, Holm-corrected together.",
        "",
        "The **ideal estimator** (`softmax-masses`) is the softmax model told the true masses at "
        "every token, pretrained and fine-tuned like every arm: an upper bound on what a probe "
        "could read of the masses, so its exponents show what this pipeline (probe size, "
        "fine-tuning, regression) returns from a model that need not infer them. It is not a "
        "model that found the physics, and not an attention arm: it is never compared for the "
        "claim.",
        "",
        "How to read the exponents: r is visible in every token, but the masses must be inferred "
        "from the motion. A probe that infers them imprecisely shrinks its mass estimates "
        "towards the mean (an MSE-trained regressor does), which pulls α and β below 1; the "
        "ceiling removes that dependence, so an arm further than its ceiling has a mass (or "
        "distance) dependence that is not Newton's.",
        "",
    ]


def _setting(p: Any, results: list[dict[str, Any]], data_info: dict[str, Any]) -> list[str]:
    cfg, counts = data_info["config"], data_info["counts"]
    model_rs = [r for r in results if r["pretrain"] is not None]
    params = f", {model_rs[0].get('params', '?')} parameters" if model_rs else ""
    return [
        "## Setting",
        "",
        f"- Data: {sum(counts.values())} two-body systems (kepler preset `{p.data_preset}` + "
        f"{json.dumps(p.data)}), split train / probe / test = {counts['train']} / "
        f"{counts['probe']} / {counts['test']} (disjoint systems), {cfg['n_steps']} steps each, "
        f"dt = {cfg['dt']}, m1 ∈ {cfg['m1_range']}, m2 ∈ {cfg['m2_range']}, a ∈ "
        f"{cfg['a_range']}, e ≤ {cfg['e_max']}, G = {cfg['G']:.4g}; `{p.fmt}` tokens (dt token, "
        "then planet, star per step).",
        f"- Model: {p.n_layer} layers, {p.n_embd} wide, {p.n_head} heads, RoPE{params}; "
        f"softmax-local window {p.window} tokens.",
        f"- Pretraining: next-token {'MSE' if p.fmt == 'continuous' else 'cross-entropy'}, "
        f"{p.pretrain_steps} steps × batch {p.pretrain_batch} systems, AdamW lr "
        f"{p.pretrain_lr}, identical data order for every arm.",
        f"- Force probe: log |F| at the star token of each step ≥ {p.first_step}; whole model "
        f"fine-tuned {p.finetune_steps} steps × batch {p.finetune_batch} on the probe systems "
        f"(lr {p.finetune_lr}); separately a ridge probe (α = {p.ridge_alpha}) on the frozen "
        "pretrained trunk. Evaluated on the unseen test systems.",
        f"- Symbolic regression on {p.sr_points} (system, step) test points, the same points "
        f"for every arm of a seed: power law with {p.n_boot} bootstrap resamples, sparse "
        f"log-library search (BIC), GP ({results[0]['sr']['gp']['backend']}, "
        f"{p.sr_budget_s:g} s budget; its formula counts as Newton when its local exponents' "
        f"5th–95th percentiles lie within {p.tol:g} of (1, 1, −2)). Noise ceiling: "
        f"{p.ceiling_draws} draws; equivalence margin ±{p.margin:g}. Seeds: "
        f"{sorted({r['seed'] for r in results})}.",
        "",
    ]


def _summary(results: list[dict[str, Any]], explore: dict[str, Any]) -> list[str]:
    L = [
        "## Exponent errors by arm",
        "",
        "Means with 95% t intervals over seeds. Ceiling: the arm's noise ceiling (mean over its "
        "draws, then over seeds); arm − ceiling paired by seed. Within ceiling: runs whose "
        "largest error is at most their ceiling's 95th percentile (per run, no margin).",
        "",
        "| arm | seeds | probe R² (log F) | \\|α−1\\| | \\|β−1\\| | \\|γ+2\\| | max error "
        "| ceiling max error | vs its ceiling | within ceiling | power-law R² | ceiling R² |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in by_seed(results).items():
        iv = arm_intervals(runs)
        rs = list(runs.values())
        probe = (
            fmt_iv(mean_ci([r["probe"]["test_r2"] for r in rs]), fixed=True)
            if rs[0]["probe"]
            else "–"
        )
        ceil = iv["ceiling_max_err"]
        L.append(
            f"| {arm} | {iv['n']} | {probe} | "
            + " | ".join(fmt_iv(iv[k], fixed=True) for k in ERRORS)
            + f" | {'–' if ceil is None else fmt_iv(ceil, fixed=True)}"
            f" | {explore[arm]['ceiling']['label'] if arm in explore else '–'}"
            f" | {_within(iv)}"
            f" | {fmt_iv(iv['r2'], fixed=True)}"
            f" | {'–' if iv['ceiling_r2'] is None else fmt_iv(iv['ceiling_r2'], fixed=True)} |"
        )
    L += [
        "",
        "## Paired comparisons (exploratory)",
        "",
        "Largest exponent error, arm minus reference, paired by seed (95% t interval; "
        "uncorrected: these are not the declared claim).",
        "",
        "| arm | − softmax | verdict | − lssar | verdict |",
        "|---|---|---|---|---|",
    ]
    for arm, row in explore.items():
        cells = []
        for ref in ("softmax", "lssar"):
            c = row.get(ref)
            if c is None:
                cells += ["–", "–"]
            else:
                cells += [fmt_iv(_iv(c["diff"]), signed=True, fixed=True), c["label"]]
        L.append(f"| {arm} | " + " | ".join(cells) + " |")
    return L + [""]


def _iv(d: dict[str, Any]) -> Interval:
    return Interval(**d)


def _within(iv: dict[str, Any]) -> str:
    return "–" if iv["within"] is None else f"{iv['within']}/{iv['n']}"


def _every_run(results: list[dict[str, Any]]) -> list[str]:
    L = [
        "## Every run",
        "",
        "Exponents with 95% bootstrap intervals over points; ceiling: mean exponents over its "
        "draws and its largest error (mean / 95th percentile). GP Newton: the GP formula's local "
        "exponents lie in the band; on the ceiling: the same for the GP run on one ceiling draw.",
        "",
        "| arm | seed | probe R² fit / test | α | β | γ | R² | max error | ceiling α, β, γ "
        "| ceiling max error | within ceiling | GP Newton | GP Newton on ceiling | GP R² |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sr, pl, c = r["sr"], r["sr"]["power_law"], r["ceiling"]
        pr = r["probe"]
        fit_test = "–" if pr is None else f"{pr['probe_r2']:.3f} / {pr['test_r2']:.3f}"
        exps = []
        for k in EXPONENTS:
            lo, hi = pl["ci95"][k]
            exps.append(f"{pl[k]:.3f} [{lo:.3f}, {hi:.3f}]")
        L.append(
            f"| {r['arm']} | {r['seed']} | {fit_test} | "
            + " | ".join(exps)
            + f" | {pl['r2']:.4f} | {sr['errors']['max_err']:.3f}"
            + (
                " | – | – "
                if c is None
                else " | "
                + ", ".join(f"{c[k]:.3f}" for k in EXPONENTS)
                + f" | {c['max_err']:.3f} / {c['max_err_q95']:.3f} "
            )
            + f"| {_yn(r['within_ceiling'])} | {_yn(sr['gp']['is_newton'])} "
            f"| {_yn(None if c is None else c['sr']['gp']['is_newton'])} "
            f"| {_f(sr['gp']['r2'], '.4f')} |"
        )
    L += ["", "## Recovered formulas", ""]
    for r in results:
        sr, c = r["sr"], r["ceiling"]
        L += [
            f"**{r['arm']}, seed {r['seed']}**",
            f"- GP: `F = {sr['gp']['expression']}`",
            f"- sparse search: `{sr['sparse']['law'] or '(subsets disagree on the law)'}`",
            f"- power law: `{sr['power_law']['formula']}`",
        ]
        if c is not None:
            L.append(f"- GP on one draw of its noise ceiling: `F = {c['sr']['gp']['expression']}`")
        L.append("")
    ridge = [r for r in results if "ridge_power_law" in r["sr"]]
    if ridge:
        L += [
            "## Frozen-trunk ridge probe",
            "",
            "Power law fitted to the ridge probe's forces (pretrained trunk, not fine-tuned; "
            "for `scratch`: the random-init trunk).",
            "",
            "| arm | seed | ridge R² (log F) | α | β | γ | R² | max error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in ridge:
            pl = r["sr"]["ridge_power_law"]
            L.append(
                f"| {r['arm']} | {r['seed']} | {r['probe']['ridge_test_r2']:.3f} | "
                + " | ".join(f"{pl[k]:.3f}" for k in EXPONENTS)
                + f" | {pl['r2']:.4f} | {pl['errors']['max_err']:.3f} |"
            )
        L.append("")
    return L


def write_report(
    preset_name: str,
    p: Any,
    results: list[dict[str, Any]],
    out: Path,
    seconds: float,
    data_info: dict[str, Any],
    env: dict[str, Any],
    computed: list[str],
) -> Path:
    """Write ``REPORT.md``, ``results.json``, ``force_scatter.png`` and ``exponents.png`` in
    ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    v = claim(results, p.margin)
    explore = exploratory(results, p.margin)
    L = [
        f"# lssar orbits --preset {preset_name}",
        "",
        provenance_head([r.get("env", {}) for r in results], env)
        + f" Results computed at commit {', '.join(sorted(_shas(results)))}; this report at "
        f"{str(env.get('git_sha'))[:10]}.",
        "",
        f"{p.description}. Generated by `lssar orbits --preset {preset_name}` from the run "
        f"directories ({Path(results[0]['run_dir']).parent}) in {seconds / 60:.1f} min "
        f"({len(computed)} stage(s) computed by this invocation, the rest reused). "
        f"Compute recorded in the run directories: {_compute(results)}.",
        "",
        "## Claim under test",
        "",
        "Paper v5 (docs/method.md section 7, after Vafa et al. 2025): a GPT pretrained on "
        "planetary trajectories and fine-tuned to predict forces yields, through symbolic "
        "regression on its predictions, Newton's F ∝ m1·m2/r² with LSSAR, and physically "
        "meaningless formulas with softmax.",
        "",
        v["text"],
        "",
        *_controls(results, explore, p.tol),
        "",
        *_method(p),
        *_setting(p, results, data_info),
        *_summary(results, explore),
    ]
    model_rs = [r for r in results if r["pretrain"] is not None]
    base = [r["pretrain"].get("baselines") for r in model_rs if r["pretrain"].get("baselines")]
    if base:
        b = base[0]
        L += [
            "The continuous pretrain loss is the next position's squared error in units of the "
            "rms deviation from constant-velocity motion (a·dt², train split): "
            + ", ".join(
                f"{a} {_ms([r['pretrain']['test_loss'] for r in rs.values()], '.2e')}"
                for a, rs in by_seed(model_rs).items()
            )
            + f". Baselines on the same test tokens: constant velocity "
            f"{b['constant_velocity']:.3f}, constant acceleration {b['constant_acceleration']:.3f};"
            " a loss well below the latter means the model predicts the gravitational "
            "acceleration, not just inertia.",
            "",
        ]
    L += _every_run(results)
    plots = write_plots(results, out, p.first_step)
    L += [
        "## Plots",
        "",
        *[f"![{n}]({n})" for n in plots],
        "",
        *environment_section(env),
    ]
    summary = {}
    for arm, runs in by_seed(results).items():
        iv = arm_intervals(runs)
        rs = list(runs.values())
        summary[arm] = {
            **{k: float(np.mean([r["sr"]["power_law"][k] for r in rs])) for k in EXPONENTS},
            **{k: dataclasses.asdict(iv[k]) for k in ERRORS},
            "ceiling_max_err": None
            if iv["ceiling_max_err"] is None
            else dataclasses.asdict(iv["ceiling_max_err"]),
            "vs_ceiling": explore.get(arm, {}).get("ceiling", {}).get("label"),
            "within_ceiling": iv["within"],
            "probe_test_r2": float(np.mean([r["probe"]["test_r2"] for r in rs]))
            if rs[0]["probe"]
            else None,
        }
    payload = {
        "preset": preset_name,
        "settings": dataclasses.asdict(p),
        "data": data_info,
        "verdict": v,
        "comparisons": explore,
        "summary": summary,
        "target": dict(zip(EXPONENTS, TARGET.tolist(), strict=True)),
        "runs": results,
        "seconds": seconds,
        "computed": computed,
        "env": env,
    }
    return write_files(out, L, payload)
