"""`lssar reproduce`: the whole command (its progress, workers, the smoke preset), the paper plan
and its decomposition rows, and the environment and conditions every result records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lssar.cli import main as cli_main
from lssar.ops.variants import VARIANTS
from lssar.studies import common
from lssar.studies.lm import presets
from lssar.studies.lm import report as reproduce_report
from lssar.studies.lm import study as lm_study
from lssar.train.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_whole_command_progress_reads_the_runs_logs(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for r in runs:
        r.mkdir()
    (runs[0] / "log.jsonl").write_text('{"event": "train", "step": 50}\n')  # resumed from 50
    progress = lm_study.CommandProgress(runs, steps_per_run=175)
    assert progress.before == 50 and "time left: after the first logged steps" in progress.line()
    progress.started -= 60.0  # a minute into the command
    with (runs[0] / "log.jsonl").open("a") as f:
        f.write('{"event": "train", "step": 150}\n{"event": "tr')  # a line being appended
    line = progress.line()
    assert line.startswith("[whole command] 150/350 training steps over 2 runs, 1.0 min elapsed")
    assert line.endswith("about 2 min left")  # 200 steps at 100 steps a minute
    for r in runs:
        (r / "log.jsonl").write_text('{"event": "train", "step": 175}\n')
    assert progress.line().endswith("training done, the last evaluations are running")


def test_reproduce_with_workers_trains_each_run_once_and_keeps_the_order(tmp_path, monkeypatch):
    """--jobs 2: arms sharing a run (softmax, its window, its RoPE scalings) are one unit, so no
    two workers train one run; the report reads the results in (seed, arm) order."""
    seen: dict = {}

    def fake_units(fn, units, jobs=1, on_done=None, check=None, names=None):
        seen["jobs"], seen["units"], seen["names"] = jobs, units, names
        for unit in units:  # no run exists yet: every unit passes
            check(*unit)
        return [[[{"arm": a, "seed": u[3]}] for a in u[2]] for u in units]

    def fake_report(name, preset, results, out, seconds):
        seen["results"] = results
        return out

    monkeypatch.setattr(common, "run_units", fake_units)
    monkeypatch.setattr(reproduce_report, "write_report", fake_report)
    lm_study.run_study("cpu-baselines", tmp_path / "runs", tmp_path / "rep", jobs=2)
    preset = presets.PRESETS["cpu-baselines"]
    assert seen["jobs"] == 2
    groups = [(u[3], u[2]) for u in seen["units"]]
    roped = ("softmax", *(a for a in preset.arms if a.startswith("softmax -> ")))
    assert groups[0] == (0, roped) and len(groups) == 5 * 3  # 5 runs per seed
    assert seen["names"][0] == f"the run of {', '.join(roped)} (seed 0)"
    names = [lm_study._run_name("tiny-cpu", presets.ARMS[a[0]], s) for s, a in groups]
    assert len(set(names)) == len(names)
    assert [(r["seed"], r["arm"]) for r in seen["results"]] == [
        (s, a) for s in preset.seeds for a in preset.arms
    ]
    with pytest.raises(ValueError, match="--jobs 0"):
        lm_study.run_study("quick", tmp_path / "runs", jobs=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="under torchrun"):
        lm_study.run_study("quick", tmp_path / "runs", jobs=2)


def test_reproduce_smoke_is_a_small_copy_of_the_preset_kept_apart(tmp_path, monkeypatch):
    """--smoke: the preset's arms on one seed for a few steps and tokens, its own runs directory,
    evaluation folder and report name; the command line's overrides still win."""
    from lssar.train.config import load_config

    cpu = presets.PRESETS["cpu"]
    smoke = presets.get_preset("cpu", smoke_test=True)
    assert smoke.arms == cpu.arms and smoke.seeds == [0] and smoke.multiples == [1, 2]
    assert smoke.eval_tokens == 256 and smoke.eval_folder == "smoke"
    assert smoke.passkey.steps == 2 and smoke.passkey.digits == cpu.passkey.digits
    assert smoke.description.startswith("SMOKE TEST, not a result")
    cfg = load_config(smoke.train_preset, smoke.train)  # a valid training config
    assert (cfg.max_steps, cfg.eval_tokens, cfg.batch_size) == (presets.SMOKE_STEPS, 256, 4)
    with pytest.raises(ValueError, match="unknown preset 'nope'; choose from quick"):
        presets.get_preset("nope", smoke_test=True)

    seen: dict = {}

    def fake_units(fn, units, jobs=1, on_done=None, check=None, names=None):
        seen["units"] = units
        return [[[{"arm": a}] for a in u[2]] for u in units]

    def fake_report(name, preset, results, out, seconds):
        seen["report"] = (name, preset, out)
        return out

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "run_units", fake_units)
    monkeypatch.setattr(reproduce_report, "write_report", fake_report)
    out = lm_study.run_study("quick", progress=False, smoke=True)
    assert {(u[1], u[4]) for u in seen["units"]} == {
        ("smoke", Path("runs/reproduce-smoke-tiny-cpu"))
    }
    name, preset, where = seen["report"]
    assert name == "quick --smoke" and preset.seeds == [0] and out == where
    assert out.parent == Path("reports") and out.name.startswith("quick-smoke-")

    # each unit trains with the smoke settings under the command line's overrides
    trained: dict = {}

    def fake_train(cfg, resume=True, progress=True):
        trained["cfg"] = cfg
        return tmp_path / "run"

    def fake_eval(run, **kw):
        trained.setdefault("evals", []).append(kw)
        return {}

    monkeypatch.setattr("lssar.train.train", fake_train)
    monkeypatch.setattr(lm_study, "evaluate_run", fake_eval)
    unit = seen["units"][0]
    lm_study._train_and_evaluate(*unit[:5], ["max_steps=2"], False)
    cfg = trained["cfg"]
    assert (cfg.max_steps, cfg.batch_size, cfg.eval_tokens, cfg.seed) == (2, 4, 256, 0)
    assert {e["folder"] for e in trained["evals"]} == {"smoke"}
    assert {tuple(e["multiples"]) for e in trained["evals"]} == {(1, 2)}


def _changes(a: str, b: str) -> int:
    """How many things two arms' trained rules differ in: phi (with its normalisation), the
    scale rule (sdpa / ln N_i / frozen, with or without a learned s_h), the d of its ln d,
    QK-norm, re-weighting."""
    va, vb = (VARIANTS[presets.ARMS[x].attention.name] for x in (a, b))
    pa, pb = (presets.ARMS[x].attention.options.get("p") for x in (a, b))
    da, db = (presets.ARMS[x].attention.options.get("scale_dim") for x in (a, b))
    things = [
        da != db,
        (va.phi, va.l1, va.divide_by_n) != (vb.phi, vb.l1, vb.divide_by_n),
        (va.scaling, "s" in va.options) != (vb.scaling, "s" in vb.options),
        va.qk_norm != vb.qk_norm,
        (pa if pa is not None else va.options.get("p"))
        != (pb if pb is not None else vb.options.get("p")),
    ]
    return sum(things)


def test_decomposition_rows_change_one_thing_unless_they_say_two():
    for question, a, b in reproduce_report.DECOMPOSITION:
        if reproduce_report.WINDOW in (a, b):
            continue
        want = 2 if "(two changes" in question else 1
        assert _changes(a, b) == want, (question, a, b)
    decomposition = presets.PRESETS["cpu-decomposition"]
    # every row's arms are in the preset, which shares cpu's runs and evaluations
    for _, a, b in reproduce_report.DECOMPOSITION:
        if a in presets.DECOMPOSITION_ARMS or b in presets.DECOMPOSITION_ARMS:
            assert {a, b} <= set(decomposition.arms), (a, b)
    assert decomposition.eval_folder == "cpu" and decomposition.seeds == [0, 1, 2]
    assert decomposition.passkey == presets.PRESETS["cpu"].passkey


def test_paper_regime_preset_is_head_dim_64_trained_4x_cpu():
    regime, cpu = presets.PRESETS["cpu-paper-regime"], presets.PRESETS["cpu"]
    cfg, base = load_config(regime.train_preset, {}), load_config(cpu.train_preset, {})
    assert cfg.n_embd // cfg.n_head == 64 and base.n_embd // base.n_head == 32
    assert cfg.max_steps == 4 * base.max_steps == 1800
    same = ("n_layer", "n_embd", "seq_len", "batch_size", "lr", "min_lr", "corpus", "tokenizer")
    assert [getattr(cfg, k) for k in same] == [getattr(base, k) for k in same]
    assert regime.arms == [
        "softmax", "window", "softmax-qknorm-logn", "lssa", "lssar p=15", "softmax + alibi",
    ]  # fmt: skip
    assert regime.seeds == [0, 1, 2] and "--jobs 2" in regime.budget


def test_the_fp32_headline_preset_trains_in_fp32_in_runs_of_its_own():
    fp32, regime = presets.PRESETS["cpu-paper-regime-fp32"], presets.PRESETS["cpu-paper-regime"]
    assert fp32.train_preset == regime.train_preset and fp32.train == {"dtype": "fp32"}
    assert len(fp32.seeds) >= 5 and fp32.passkey is None
    # a run of the same name with bf16 autocast would be refused: the runs live apart
    assert lm_study.runs_suffix(fp32) == "-dtype-fp32" and lm_study.runs_suffix(regime) == ""
    assert lm_study.runs_suffix(fp32, smoke=True) == ""


def test_the_factorial_cells_change_one_thing_at_a_time():
    """head dim x steps in fp32: each cell differs from its neighbours in head dim (heads at
    width 128) or in steps (with their warmup) only; the d = 64 / 1,800 cell is the fp32
    headline preset."""
    cfg = {
        (d, n): load_config(p.train_preset, p.train)
        for (d, n), p in {
            (32, 450): presets.PRESETS["cpu-cell-d32-450"],
            (64, 450): presets.PRESETS["cpu-cell-d64-450"],
            (32, 1800): presets.PRESETS["cpu-cell-d32-1800"],
            (64, 1800): presets.PRESETS["cpu-paper-regime-fp32"],
        }.items()
    }
    for (d, n), c in cfg.items():
        assert (c.n_embd // c.n_head, c.max_steps, c.dtype) == (d, n, "fp32")

    def differ(a, b):
        """The settings of cells a and b that differ (the preset's name aside)."""
        return {k for k, v in vars(cfg[a]).items() if getattr(cfg[b], k) != v} - {"preset"}

    assert differ((32, 450), (64, 450)) == {"n_head"}
    assert differ((32, 1800), (64, 1800)) == {"n_head"}
    assert differ((32, 450), (32, 1800)) == {
        "max_steps",
        "warmup_steps",
        "eval_every",
        "ckpt_every",
    }
    runs = {lm_study.runs_suffix(presets.PRESETS[f"cpu-cell-d{d}-{n}"]) for d, n in cfg if n == 450}
    assert len(runs) == 2  # the cells' runs live apart
    # the d = 32 cells carry the ln d arm: head dim 64's scale on the head-dim-32 model
    lnd = presets.ARMS["lssar p=15 scale_dim=64"].attention
    assert lnd.options == {"p": 15.0, "scale_dim": 64}
    assert "lssar p=15 scale_dim=64" in presets.PRESETS["cpu-cell-d32-450"].arms
    assert "lssar p=15 scale_dim=64" not in presets.PRESETS["cpu-cell-d64-450"].arms


def test_reproduce_rejects_unknown_preset_and_prints_the_paper_plan(capsys):
    assert cli_main(["reproduce", "--preset", "huge"]) == 2
    assert (
        "choose from quick, cpu, cpu-baselines, cpu-decomposition, cpu-paper-regime, "
        "cpu-paper-regime-fp32, paper, cpu-cell-d32-450" in capsys.readouterr().err
    )
    assert cli_main(["reproduce", "--preset", "paper"]) == 0
    plan = capsys.readouterr().out
    assert plan.count("torchrun --standalone --nproc_per_node=8 -m lssar train") == 9
    assert "--preset gpt2-124m-fineweb --attn=lssar --attn_p=15" in plan


def test_environment_records_argv_relative_to_the_project(monkeypatch):
    from lssar import runio

    root = runio.PROJECT_ROOT
    argv = [
        str(root / "lssar" / "__main__.py"),
        "eval",
        str(root / "runs" / "x"),
        f"--out_dir={root / 'runs'}",
        "/elsewhere/run",
        "--lr=0.1",
    ]
    monkeypatch.setattr(runio.sys, "argv", argv)
    env = runio.environment()
    assert env["argv"] == [
        "lssar/__main__.py",
        "eval",
        "runs/x",
        "--out_dir=runs",
        "/elsewhere/run",
        "--lr=0.1",
    ]
    assert len(env["git_sha"]) == 40 and isinstance(env["git_dirty"], bool)


@pytest.mark.parametrize(
    "status, dirty",
    [
        ("", False),
        ("?? reports/quick-2026-12-02/", False),  # a new report does not change results
        ("?? notes.txt\n?? runs-link", False),
        (" M README.md", True),  # any tracked change
        (" M reports/recall-cpu-2026-12-03/REPORT.md", False),  # but a regenerated report
        ("?? reports/x/\n M lssar/model.py", True),
        ("?? lssar/ops/new_kernel.py", True),  # untracked code
        ("?? lssar/configs/mine.toml", True),  # an untracked preset
        (None, None),  # not a git checkout
    ],
)
def test_git_dirty_counts_tracked_changes_and_untracked_code(monkeypatch, status, dirty):
    import subprocess

    from lssar import runio

    # git's own output, through _git: the first line's leading space must survive
    out = subprocess.CompletedProcess(
        [], 0 if status is not None else 128, (status or "") + "\n", ""
    )
    monkeypatch.setattr(runio.subprocess, "run", lambda *a, **k: out)
    monkeypatch.setattr(runio, "in_checkout", lambda: status is not None)
    assert runio.git_dirty() is dirty


def test_conditions_say_which_commands_threads_and_isa_made_the_results():
    from lssar.studies.common import conditions

    own = {"argv": ["lssar/__main__.py", "reproduce", "--preset", "cpu"], "threads": 1}
    own["cpu_isa"] = "AVX512"
    text = conditions([own, {**own, "cpu_isa": "AVX2", "threads": 2}])
    assert text.startswith("Trained and evaluated by the project's own commands only")
    assert "`lssar reproduce --preset cpu`" in text
    assert "threads per process: 1, 2" in text and "CPU ISA: AVX2, AVX512" in text
    adhoc = conditions([own, {"argv": ["scripts/mine.py", "--x"]}, {}])
    assert adhoc.startswith("**Not only the project's commands**: also `scripts/mine.py --x`")
    assert "; the project's: `lssar reproduce --preset cpu`" in adhoc
    assert "1 of 3 results do not record their command" in adhoc


def test_finished_units_are_carried_in_the_report_directory(tmp_path, monkeypatch):
    """A finished unit's results go to REPORT_DIR/units/<run>.json with its key, so the same
    --out on a fresh machine (no runs) reuses them; a unit whose settings changed, or whose
    file is damaged, runs again."""
    calls: list = []

    def fake_unit(preset, folder, arms, seed, runs, overrides, progress):
        calls.append((arms, seed))
        return [[{"arm": a, "seed": seed, "loss": {"128": 1.5}}] for a in arms]

    monkeypatch.setattr(lm_study, "_train_and_evaluate", fake_unit)
    monkeypatch.setattr(reproduce_report, "write_report", lambda n, p, rs, out, s: out)
    out = tmp_path / "rep"
    run = lambda runs, **kw: lm_study.run_study(  # noqa: E731
        "quick", tmp_path / runs, out, progress=False, **kw
    )
    run("runs")
    quick = presets.PRESETS["quick"]
    files = sorted(p.name for p in (out / "units").iterdir())
    assert files == [
        "tiny-cpu-lssa-s0.json",
        "tiny-cpu-lssar-p15-s0.json",
        "tiny-cpu-softmax-s0.json",
    ]
    assert len(calls) == 3
    doc = json.loads((out / "units" / "tiny-cpu-softmax-s0.json").read_text())
    assert doc["key"]["train"]["seed"] == 0 and "out_dir" not in doc["key"]["train"]
    assert doc["key"]["eval"] == {"multiples": quick.multiples, "eval_tokens": quick.eval_tokens}
    assert [r[0]["arm"] for r in doc["results"]] == ["softmax", "window"]

    # another machine: no runs directory, and a run there with other settings is not in the way
    calls.clear()
    stale = tmp_path / "elsewhere" / "tiny-cpu-softmax-s0"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text(json.dumps({"max_steps": 1}))
    run("elsewhere")
    assert calls == []
    # other settings (here: the steps) are another key: every unit runs again
    run("elsewhere2", overrides=["--max_steps=7"])
    assert len(calls) == 3
    # a damaged carried file runs its unit again, and is rewritten
    calls.clear()
    (out / "units" / "tiny-cpu-lssa-s0.json").write_text('{"key": ')
    run("elsewhere3", overrides=["--max_steps=7"])
    assert calls == [(("lssa",), 0)]
    assert json.loads((out / "units" / "tiny-cpu-lssa-s0.json").read_text())["results"]


def test_report_only_rewrites_a_report_from_its_results(tmp_path, capsys):
    """--report-only: the report rewritten from its own results.json with this version's
    report code, its results unchanged; another preset's report, or no --out, is refused."""
    src = Path(__file__).resolve().parents[2] / "reports" / "quick-2026-12-03"
    out = tmp_path / "quick"
    out.mkdir()
    before = json.loads((src / "results.json").read_text())
    (out / "results.json").write_text(json.dumps(before))
    assert cli_main(["reproduce", "--preset", "quick", "--report-only", "--out", str(out)]) == 0
    text = (out / "REPORT.md").read_text()
    assert "Rewritten by `lssar reproduce --preset quick --report-only`" in text
    assert json.loads((out / "results.json").read_text())["results"] == before["results"]
    assert (out / "loss_vs_length.png").is_file()
    assert cli_main(["reproduce", "--preset", "cpu", "--report-only", "--out", str(out)]) == 2
    assert "a report of preset 'quick', not 'cpu'" in capsys.readouterr().err
    assert cli_main(["reproduce", "--preset", "quick", "--report-only"]) == 2
    assert "name it with --out DIR" in capsys.readouterr().err
