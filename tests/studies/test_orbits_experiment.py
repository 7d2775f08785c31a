"""Tests for the orbits experiment (lssar.studies.orbits: the study, its stages and report, its
CLI errors; the models are in test_orbits_models.py)."""

import json
import shutil

import pytest

from lssar.cli import main
from lssar.studies.orbits import study as ex
from lssar.studies.orbits import symreg
from lssar.train.checkpoint import VERSION as CKPT_VERSION
from lssar.train.checkpoint import load_checkpoint


def _dirs(root, preset):
    """The runs and the report of ``preset`` under ``root`` (the layout of ``--out`` before)."""
    return root / "runs" / f"orbits-{preset}", root / "reports" / f"orbits-{preset}"


def _cli(tmp_path):
    """``lssar orbits`` with its runs and report in ``tmp_path``."""
    return ["orbits", "--runs", str(tmp_path / "r"), "--out", str(tmp_path)]


# Tiny sizes: the whole pipeline (data, pretraining, probes, SR, report) in seconds.
MICRO = {
    "data.n_systems": 120,
    "data.n_steps": 12,
    "n_layer": 2,
    "n_embd": 32,
    "pretrain_steps": 4,
    "finetune_steps": 4,
    "first_step": 4,
    "sr_points": 60,
    "sr_budget_s": 2.0,
    "n_boot": 20,
}


ARMS = ["softmax", "lssar", "softmax-masses", "oracle"]


@pytest.fixture(scope="module")
def micro(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("orbits")
    first = ex.run_study("quick", ARMS, [0], *_dirs(out, "quick"), MICRO, progress=False)
    return out, first


def test_micro_end_to_end_report(micro):
    out, first = micro
    rep = first["report"]
    text = (rep / "REPORT.md").read_text()
    assert "## Exponent errors by arm" in text and "Claim under test" in text
    assert "## The Newton criterion" in text and "noise ceiling" in text
    for arm in ARMS:
        assert f"| {arm} |" in text
    assert (rep / "force_scatter.png").exists() and (rep / "exponents.png").exists()
    res = json.loads((rep / "results.json").read_text())
    assert set(res) >= {"preset", "settings", "data", "verdict", "summary", "runs", "env"}
    assert res["verdict"]["status"] == "no interval"  # one seed: described, never judged
    assert res["verdict"]["text"].split("\n")[0] in text
    assert set(res["comparisons"]) == {"softmax", "lssar", "softmax-masses"}
    assert [r["arm"] for r in res["runs"]] == ARMS
    for r in res["runs"]:
        assert {"seed", "sr", "ceiling", "within_ceiling", "pretrain", "probe"} <= set(r)
        pl = r["sr"]["power_law"]
        assert {"alpha", "beta", "gamma", "r2", "ci95"} <= set(pl)
        errs = [abs(pl["alpha"] - 1), abs(pl["beta"] - 1), abs(pl["gamma"] + 2)]
        assert r["sr"]["errors"]["max_err"] == pytest.approx(max(errs))
        assert "expression" in r["sr"]["gp"]
        if r["arm"] != "oracle":
            assert r["pretrain"]["steps"] == MICRO["pretrain_steps"]
            assert -10 < r["probe"]["test_r2"] <= 1 and "ridge_test_r2" in r["probe"]
            run_dir = out / "runs" / "orbits-quick" / f"{r['arm']}-s0"
            for f in ("pretrained.pt", "finetuned.pt", "predictions.npz", "result.json"):
                assert (run_dir / f).exists()
            for f in ("pretrained.pt", "finetuned.pt"):  # models in the one checkpoint format
                assert load_checkpoint(run_dir / f)["version"] == CKPT_VERSION
            assert "git_sha" in json.loads((run_dir / "env.json").read_text())
            c = r["ceiling"]
            assert c["max_err"] <= c["max_err_q95"] and c["n_draws"] == 200
            assert c["sr"]["n_points"] == MICRO["sr_points"] and "expression" in c["sr"]["gp"]
            assert r["within_ceiling"] == (r["sr"]["errors"]["max_err"] <= c["max_err_q95"])
    runs = out / "runs" / "orbits-quick"
    for arm in ("softmax", "softmax-masses"):  # only the ideal estimator is told the masses
        cfg = json.loads((runs / f"{arm}-s0" / "config.json").read_text())
        assert cfg["model"]["sees_masses"] == (arm == "softmax-masses")
        assert cfg["model"]["attn"] == "softmax"


def test_oracle_recovers_newton_exactly(micro):
    _, first = micro
    oracle = next(r for r in first["results"] if r["arm"] == "oracle")
    gp = oracle["sr"]["gp"]
    assert gp["is_newton"] and gp["newton_G"] == pytest.approx(1.0)  # G = 1 in this preset
    assert symreg.newton_constant(gp["expression"]) == pytest.approx(1.0)
    assert oracle["sr"]["errors"]["max_err"] == pytest.approx(0.0, abs=1e-9)
    assert oracle["sr"]["power_law"]["gamma"] == pytest.approx(-2.0, abs=1e-9)
    assert oracle["ceiling"] is None and oracle["within_ceiling"] is None


def test_rerun_reuses_every_stage(micro):
    out, _ = micro
    runs = out / "runs" / "orbits-quick"

    def stamps():  # the lock file names its latest holder: it is rewritten on every run
        return {
            p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file() and p.name != ".lock"
        }

    before = stamps()
    again = ex.run_study("quick", ARMS, [0], *_dirs(out, "quick"), MICRO, progress=False)
    assert again["computed"] == []
    assert stamps() == before


def test_changed_code_recomputes_every_stage(micro, tmp_path, monkeypatch):
    src, _ = micro
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    monkeypatch.setattr(ex, "code_digest", lambda sources: "other-code")
    again = ex.run_study(
        "quick", ["softmax", "oracle"], [0], *_dirs(out, "quick"), MICRO, progress=False
    )
    assert again["computed"] == [
        "softmax-s0:pretrain",
        "softmax-s0:probe",
        "softmax-s0:sr",
        "oracle-s0:sr",
    ]


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("data.nope=1", r"unknown setting 'data\.nope'; valid data\.<field>: G, a_range"),
        ("pretrain_steps=-5", r"pretrain_steps=-5 must be a whole number >= 1"),
        ("finetune_steps=0", r"finetune_steps=0 must be a whole number >= 1"),
        ("finetune_lr=nan", r"finetune_lr=nan must be a finite number > 0"),
        ("window=0", r"window=0 must be"),
        ("margin=-0.1", r"margin=-0.1 must be > 0"),
        ("ceiling_draws=0", r"ceiling_draws=0 must be a whole number >= 1"),
    ],
)
def test_bad_set_is_one_error_line_before_anything_is_written(setting, match, tmp_path, capsys):
    with pytest.raises(ValueError, match=match):
        ex.resolve_preset("quick", ex.parse_set([setting]))
    assert main([*_cli(tmp_path), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


def test_changed_setting_recomputes_only_later_stages(micro, tmp_path):
    src, _ = micro
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    d = out / "runs" / "orbits-quick" / "softmax-s0"
    pre = (d / "pretrained.pt").stat().st_mtime_ns
    again = ex.run_study(
        "quick", ["softmax"], [0], *_dirs(out, "quick"), {**MICRO, "sr_points": 50}, progress=False
    )
    assert again["computed"] == ["softmax-s0:sr"]
    assert (d / "pretrained.pt").stat().st_mtime_ns == pre
    assert again["results"][0]["sr"]["n_points"] == 50


def test_killed_run_resumes_at_last_finished_stage(micro, tmp_path):
    src, _ = micro
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    runs = out / "runs" / "orbits-quick"
    # softmax killed after pretraining; lssar's checkpoint damaged (a kill mid-write)
    (runs / "softmax-s0" / "predictions.npz").unlink()
    (runs / "softmax-s0" / "result.json").unlink()
    for f in ("finetuned.pt", "predictions.npz", "result.json"):
        (runs / "lssar-s0" / f).unlink()
    (runs / "lssar-s0" / "pretrained.pt").write_bytes(b"truncated")
    pre = (runs / "softmax-s0" / "pretrained.pt").stat().st_mtime_ns
    again = ex.run_study("quick", ARMS, [0], *_dirs(out, "quick"), MICRO, progress=False)
    assert again["computed"] == [
        "softmax-s0:probe",
        "softmax-s0:sr",
        "lssar-s0:pretrain",
        "lssar-s0:probe",
        "lssar-s0:sr",
    ]
    assert (runs / "softmax-s0" / "pretrained.pt").stat().st_mtime_ns == pre
    first = {r["arm"]: r for r in micro[1]["results"]}
    for r in again["results"]:  # deterministic: the same numbers as the uninterrupted run
        assert r["sr"]["power_law"]["alpha"] == pytest.approx(
            first[r["arm"]]["sr"]["power_law"]["alpha"], abs=1e-6
        )


def test_vafa_preset_discrete_smoke(tmp_path, one_thread):
    over = {
        **MICRO,
        "data.n_systems": 60,
        "n_layer": 1,
        "n_head": 2,
        "n_bins": 64,
        "pretrain_steps": 2,
        "finetune_steps": 2,
        "sr_points": 40,
        "sr_budget_s": 1.0,
    }
    out = ex.run_study(
        "vafa",
        ["softmax", "oracle"],
        [0],
        *_dirs(tmp_path, "vafa"),
        over,
        fmt="discrete",
        progress=False,
    )
    soft = out["results"][0]
    assert soft["pretrain"]["loss"].startswith("cross-entropy")
    assert (out["report"] / "REPORT.md").exists()


def test_bad_names_raise_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="valid presets: quick, cpu, vafa"):
        ex.resolve_preset("huge")
    with pytest.raises(ValueError, match="valid arms: softmax, lssa, lssar-p3, lssar"):
        ex.check_arms(["softmax", "transformer-xl"])
    with pytest.raises(ValueError, match="unknown setting 'lr'"):
        ex.resolve_preset("quick", {"lr": 1.0})
    assert main(["orbits", "--preset", "nope", "--runs", str(tmp_path)]) == 2
    assert main(["orbits", "--arms", "softmax,bogus", "--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "valid presets" in err and "'bogus'" in err and err.count("\n") == 2


def test_ceiling_settings_are_checked_before_anything_runs(tmp_path):
    for bad, msg in (
        ({"margin": 0.0}, "margin=0.0 must be > 0"),
        ({"ceiling_draws": 0}, "ceiling_draws=0 must be a whole number >= 1"),
    ):
        with pytest.raises(ValueError, match=msg):
            ex.run_study(
                "quick",
                ["oracle"],
                [0],
                *_dirs(tmp_path, "quick"),
                {**MICRO, **bad},
                progress=False,
            )
    assert not (tmp_path / "runs").exists()


def test_cpu_preset_has_4x_the_probe_systems_of_quick():
    def counts(name):
        p = ex.resolve_preset(name)
        return [round(f * p.data["n_systems"]) for f in p.fractions]

    assert counts("quick") == [2400, 300, 300]
    assert counts("cpu") == [2400, 1200, 1200]  # same pretraining data size, 4x probe and test


def test_set_overrides_are_typed():
    got = ex.parse_set(
        ["data.m1_range=(2.0, 1.0)", "pretrain_steps=100", "sr_budget_s=5", "fractions=(.5,.3,.2)"]
    )
    assert got == {
        "data.m1_range": (2.0, 1.0),
        "pretrain_steps": 100,
        "sr_budget_s": 5.0,
        "fractions": (0.5, 0.3, 0.2),
    }
    assert isinstance(got["sr_budget_s"], float)
    with pytest.raises(ValueError, match="pretrain_steps: expected int"):
        ex.parse_set(["pretrain_steps=many"])
    with pytest.raises(ValueError, match="expected --key=value"):
        ex.parse_set(["pretrain_steps"])


def test_impossible_orbits_surface_kepler_message(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"e_max must be in \[0, 1\)"):
        ex.run_study(
            "quick",
            ["oracle"],
            [0],
            *_dirs(tmp_path, "quick"),
            {**MICRO, "data.e_max": 1.5},
            progress=False,
        )
    assert main([*_cli(tmp_path), "--set", "data.m1_range=(2.0, 1.0)"]) == 2
    assert "m1_range must satisfy" in capsys.readouterr().err


def test_missing_sr_backend_names_what_to_install(tmp_path, capsys):
    if "pysr" in symreg.installed_backends():
        pytest.skip("pysr is installed here")
    with pytest.raises(ImportError, match="pyoperon"):
        ex.run_study(
            "quick",
            ["oracle"],
            [0],
            *_dirs(tmp_path, "quick"),
            MICRO,
            backend="pysr",
            progress=False,
        )
    assert main([*_cli(tmp_path), "--sr-backend", "pysr"]) == 2
    assert "pip install pyoperon" in capsys.readouterr().err
