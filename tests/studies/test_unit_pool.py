"""Reliability of the pool that runs a study's units: every unit checked before any starts, the
first failure stops the pool, a killed worker names its run, a refused unit of reproduce or the
conversion study stops the whole study; and `lssar orbits --threads` checked."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lssar.cli import main as cli_main
from lssar.runio import RunFailure
from lssar.studies.common import run_units


def test_orbits_threads_must_be_positive(capsys):
    for bad in ("-1", "0"):
        assert cli_main(["orbits", "--threads", bad, "--preset", "quick"]) == 2
        out = capsys.readouterr().err
        assert out == f"error: --threads must be an integer >= 1, got {bad}\n"


# ---------------------------------------------------------------- the pool of study units


def _unit(tag: str, seconds: float, out: str) -> str:
    """A unit that sleeps, then leaves a file (picklable: module level)."""
    time.sleep(seconds)
    Path(out, tag).write_text(tag)
    return tag


def _refused(tag: str, seconds: float, out: str) -> str:
    raise ValueError(f"{tag}: runs/x was started with a different config")


def _killed(tag: str, seconds: float, out: str) -> str:
    from tqdm import tqdm

    tqdm(total=1, disable=True)  # as a training loop does: tqdm's lock holds semaphores
    os.kill(os.getpid(), signal.SIGKILL)
    return tag


def _check(tag: str, seconds: float, out: str) -> None:
    if tag == "changed":
        raise ValueError(f"runs/{tag} was started with a different config")


def test_every_unit_is_checked_before_any_starts(tmp_path):
    """A rerun with a changed config was refused unit by unit while the pool went on starting
    the others, one of which trained with the new config."""
    units = [(t, 0.0, str(tmp_path)) for t in ("a", "b", "changed", "c")]
    for jobs in (1, 2):
        with pytest.raises(ValueError, match="runs/changed was started with a different config"):
            run_units(_unit, units, jobs, check=_check)
        assert list(tmp_path.iterdir()) == []


def test_the_first_failure_stops_the_pool(tmp_path):
    units = [("slow", 30.0, str(tmp_path)), ("bad", 0.0, str(tmp_path))]
    units += [(t, 0.0, str(tmp_path)) for t in ("never", "again")]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="bad: runs/x was started") as e:
        run_units(_dispatch, units, 2)
    assert time.monotonic() - t0 < 30  # the slow unit was stopped, not waited for
    assert list(tmp_path.iterdir()) == []  # and nothing after the failure started
    assert "Traceback" in str(e.value.__cause__) and "_refused" in str(e.value.__cause__)


def _dispatch(tag: str, seconds: float, out: str) -> str:
    return {"bad": _refused, "dies": _killed}.get(tag, _unit)(tag, seconds, out)


def pool_with_a_killed_worker(out: str) -> None:
    """Run two units, one of which is killed; print the error (a subprocess's main)."""
    units = [("ok", 0.0, out), ("dies", 0.0, out)]
    names = ["the run of softmax (seed 0)", "the run of lssar p=15 (seed 1)"]
    try:
        run_units(_dispatch, units, 2, names=names)
    except RunFailure as e:
        print(f"RunFailure: {e}")


def test_a_killed_worker_names_its_run_and_says_a_rerun_resumes(tmp_path):
    """It was a bare BrokenProcessPool traceback and a leaked-semaphore warning (printed by
    the resource tracker as the process exits: so the pool runs in a process of its own)."""
    main = "from tests.studies.test_unit_pool import pool_with_a_killed_worker as main"
    code = f"{main}; main({str(tmp_path)!r})"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "RunFailure: the worker running the run of lssar p=15 (seed 1) was killed by signal 9 "
        "(SIGKILL) (killed by hand or for memory?); rerun the same command to resume: finished "
        "runs are reused and unfinished ones continue from their last checkpoint\n"
    )
    assert proc.stderr == "", proc.stderr  # no traceback, no leaked-semaphore warning


def test_a_refused_reproduce_unit_stops_every_unit_before_training(tmp_path):
    """The preflight of ``lssar reproduce``: a run of the preset that exists with another
    config refuses the whole command before any unit trains (here: before any starts)."""
    from lssar.studies.lm import study as lm
    from lssar.train.checkpoint import write_json

    runs, preset = tmp_path / "runs", lm.PRESETS["quick"]
    name = lambda a, s: lm._run_name(preset.train_preset, lm.ARMS[a], s)  # noqa: E731
    seed, arms = lm.units_by_run(preset.arms, preset.seeds, name)[-1]  # the last unit
    cfg = lm._unit_config(preset, arms, seed, runs, ["--max_steps=3"])
    (runs / cfg.run_name).mkdir(parents=True)
    stored = {**dataclasses.asdict(cfg), "lr": 0.5}
    write_json(runs / cfg.run_name / "config.json", {"train": stored})
    with pytest.raises(ValueError, match=r"lr: 0\.5 \(run\) != "):
        lm.run_study("quick", runs, tmp_path / "report", False, ["--max_steps=3"], jobs=2)
    assert sorted(p.name for p in runs.iterdir()) == [cfg.run_name]  # nothing else started


def test_a_refused_fine_tuning_unit_stops_every_unit_before_any_starts(tmp_path, monkeypatch):
    """The same preflight for ``lssar convert-study``: a fine-tuning run of the preset that
    exists with another config refuses the whole study before any unit runs."""
    from lssar.studies.convert import study as cs
    from lssar.train.checkpoint import write_json

    preset, runs, started = cs.PRESETS["quick"], tmp_path / "runs", []
    monkeypatch.setattr(cs, "run_unit", lambda *unit, **kw: started.append(unit))
    study = cs.ConvertStudy(preset, runs, tmp_path / "report", progress=False)
    arm, seed = study.units()[-1]  # the last unit
    cfg = cs.finetune_config(preset, arm, seed, runs)
    (runs / cfg.name).mkdir(parents=True)
    write_json(runs / cfg.name / "config.json", {**dataclasses.asdict(cfg), "lr": 0.5})
    with pytest.raises(ValueError, match=r"was started with a different config \(lr: 0\.5 \(run\)"):
        study.run()
    assert started == []
