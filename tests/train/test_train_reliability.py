"""Reliability of training runs: one trainer per run directory, torn logs, temp files
of killed writers, a full disk, a loss that stops being finite, bad input refused before the run
directory is written."""

from __future__ import annotations

import dataclasses
import errno
import math
import os
from pathlib import Path

import pytest
import torch

from lssar import data
from lssar.cli import main
from lssar.runio import LOCK_FILE, DiskFullError, LockedError
from lssar.train import loop as train_loop
from lssar.train import train
from lssar.train.checkpoint import load_checkpoint, read_log
from lssar.train.loop import DivergedError
from tests.train.test_runio import lock_held_elsewhere
from tests.train.tiny_runs import TINY, log_of, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shakespeare-byte"
    return data.prepare("shakespeare", "byte", out, max_tokens=40_000, progress=False)


def cli_args(data_dir: Path, out: Path, **kw) -> list[str]:
    over = TINY | {"data_dir": data_dir, "out_dir": out, "max_steps": 4} | kw
    return ["train", "--no-progress", *(f"--{k}={v}" for k, v in over.items())]


# ------------------------------------------------------------------------------- the lock


def test_a_second_trainer_of_a_run_is_refused_naming_the_first(data_dir, tmp_path) -> None:
    cfg = tiny(data_dir, tmp_path, run_name="r")
    run = tmp_path / "r"
    with lock_held_elsewhere(run) as other:
        with pytest.raises(LockedError, match=rf"run {run} is in use by pid {other.pid} on host"):
            train(cfg, progress=False)
        assert not (run / "config.json").exists() and not (run / "log.jsonl").exists()
    # the other trainer is gone (its lock file stays behind): the run is taken over
    assert (run / LOCK_FILE).is_file()
    train(cfg, progress=False)
    assert (run / "DONE").is_file()


def test_a_locked_run_is_one_error_line_and_exit_1(data_dir, tmp_path, capsys) -> None:
    with lock_held_elsewhere(tmp_path / "c") as other:
        assert main(cli_args(data_dir, tmp_path, run_name="c")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is in use by pid {other.pid}" in err


# ------------------------------------------------------------------- logs and temp files


def test_a_torn_last_log_line_is_dropped_and_the_run_resumes(data_dir, tmp_path, capsys) -> None:
    cfg = tiny(data_dir, tmp_path, run_name="t", ckpt_every=2)
    run = train(cfg, progress=False, _stop_after=4)
    with open(run / "log.jsonl", "a") as f:
        f.write('{"event": "train", "step": 5, "lo')  # killed in the middle of a line
    assert [r["step"] for r in read_log(run)][-1] == 4
    assert "dropped a torn last line" in capsys.readouterr().out
    train(cfg, progress=False)
    assert (run / "DONE").is_file() and [r["step"] for r in log_of(run)] == list(range(1, 9))
    lines = (run / "log.jsonl").read_text().splitlines()
    lines.insert(2, "{damaged")
    (run / "log.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"log\.jsonl line 3 is damaged .*--no-resume"):
        read_log(run)


def test_resume_removes_the_temp_file_of_a_killed_checkpoint_write(data_dir, tmp_path) -> None:
    cfg = tiny(data_dir, tmp_path, run_name="k", ckpt_every=2)
    run = train(cfg, progress=False, _stop_after=2)
    ckpt = run / "ckpt"
    half = ckpt / ".latest.pt.99999.tmp"  # what a kill during torch.save leaves
    half.write_bytes((ckpt / "latest.pt").read_bytes()[:5000])
    (run / ".log.jsonl.99999.tmp").write_text("half")
    (ckpt / "notes.tmp").write_text("not ours: kept")
    train(cfg, progress=False)
    assert not half.exists() and not (run / ".log.jsonl.99999.tmp").exists()
    assert (ckpt / "notes.tmp").is_file() and (run / "DONE").is_file()


# --------------------------------------------------------------------------- a full disk


def test_a_full_disk_during_a_checkpoint_keeps_the_last_one(
    data_dir, tmp_path, monkeypatch
) -> None:
    cfg = tiny(data_dir, tmp_path, run_name="f", ckpt_every=2)
    run = train(cfg, progress=False, _stop_after=2)
    before = (run / "ckpt" / "latest.pt").read_bytes()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the disk is full when the next checkpoint is written
        if ".latest.pt." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DiskFullError) as e:
        train(cfg, progress=False)
    msg = str(e.value)
    assert "no space left on the device writing" in msg and "latest.pt" in msg
    assert "holds the last complete checkpoint: the same command resumes from it" in msg
    assert (run / "ckpt" / "latest.pt").read_bytes() == before
    assert not [p for p in (run / "ckpt").iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    train(cfg, progress=False)  # space again: it resumes from that checkpoint
    assert (run / "DONE").is_file()


# ------------------------------------------------------------------ a non-finite loss


def test_a_diverging_run_stops_with_an_error_not_exit_0(data_dir, tmp_path, capsys) -> None:
    argv = cli_args(data_dir, tmp_path, run_name="d", lr=1e6, min_lr=0, grad_clip=0, ckpt_every=1)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite" in err and "--no-resume" in err
    run = tmp_path / "d"
    assert not (run / "DONE").exists() and read_log(run)[-1]["event"] == "error"
    if (run / "ckpt/latest.pt").exists():  # a checkpoint, if any, holds finite weights
        state = load_checkpoint(run / "ckpt/latest.pt", "cpu")["model"]
        assert all(torch.isfinite(v).all() for v in state.values())


def test_a_nan_loss_keeps_the_last_good_checkpoint(data_dir, tmp_path, monkeypatch) -> None:
    real_step = train_loop._train_step

    def step(model, opt, cfg, tokens, step, *rest):  # the loss of the 6th step is NaN
        loss = real_step(model, opt, cfg, tokens, step, *rest)
        if step == 5:
            with torch.no_grad():
                next(model.parameters()).fill_(math.nan)
            return loss * math.nan
        return loss

    monkeypatch.setattr(train_loop, "_train_step", step)
    cfg = tiny(data_dir, tmp_path, run_name="n", ckpt_every=4, log_every=3)
    with pytest.raises(DivergedError, match=r"non-finite .* at step 6; the last good checkpoint"):
        train(cfg, progress=False)
    run = tmp_path / "n"
    ckpt = load_checkpoint(run / "ckpt/latest.pt", "cpu")
    assert ckpt["step"] == 4 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
    last = read_log(run)[-1]
    assert (last["event"], last["step"]) == ("error", 6) and "non-finite" in last["error"]
    assert not (run / "DONE").exists()


def test_non_finite_weights_are_never_saved(data_dir, tmp_path, monkeypatch) -> None:
    real_step = train_loop._train_step

    def step(model, opt, cfg, tokens, step, *rest):  # weights poisoned after a finite loss
        loss = real_step(model, opt, cfg, tokens, step, *rest)
        if step == 3:  # the 4th step, whose checkpoint is due
            with torch.no_grad():
                next(model.parameters())[0, 0] = math.inf
        return loss

    monkeypatch.setattr(train_loop, "_train_step", step)
    cfg = tiny(data_dir, tmp_path, run_name="w", ckpt_every=2, log_every=100, eval_every=100)
    with pytest.raises(DivergedError, match=r"weights are no longer finite at step 4.*step 2\)"):
        train(cfg, progress=False)
    assert load_checkpoint(tmp_path / "w/ckpt/latest.pt", "cpu")["step"] == 2


# --------------------------------------------------------- bad input before anything is written


def test_an_impl_that_cannot_run_the_variant_is_refused_before_the_run_dir(
    data_dir,
    tmp_path,
    capsys,
) -> None:
    bad = cli_args(data_dir, tmp_path, run_name="x", attn="lssar", attn_impl="sdpa")
    assert main(bad) == 2
    assert "does not run variant 'lssar'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(cli_args(data_dir, tmp_path, run_name="x", attn="lssar")) == 0  # not "changed"
    assert (tmp_path / "x" / "DONE").is_file()


def test_a_data_error_leaves_no_run_dir_behind(data_dir, tmp_path) -> None:
    cfg = tiny(data_dir, tmp_path, run_name="s", seq_len=3000, eval_tokens=3000)
    with pytest.raises(ValueError, match="seq_len=3000 needs 3001"):
        train(cfg, progress=False)
    assert not (tmp_path / "s").exists()
    train(dataclasses.replace(cfg, seq_len=32, eval_tokens=256), progress=False)


def test_sample_refuses_bad_settings(data_dir, tmp_path, capsys) -> None:
    run = train(tiny(data_dir, tmp_path, run_name="smp", max_steps=2), progress=False)
    for flags, what in (
        (["--temperature", "nan"], "temperature=nan must be a finite number >= 0"),
        (["--temperature", "-1"], "temperature=-1.0 must be"),
        (["--top-k", "-5"], "top_k=-5 must be >= 0"),
        (["--max-new-tokens", "-1"], "max-new-tokens=-1 must be >= 0"),
    ):
        assert main(["sample", str(run), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and what in err, (flags, err)
    assert main(["sample", str(run), "--top-k", "0", "--max-new-tokens", "3"]) == 0


class _Planted:
    """A pickle that, loaded with weights_only=False, creates a file: code run from a run dir."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_checkpoint_is_refused_without_running_it(data_dir, tmp_path, capsys) -> None:
    cfg = tiny(data_dir, tmp_path, run_name="p")
    run = train(cfg, progress=False, _stop_after=2)
    marker = tmp_path / "code-ran"
    torch.save({"format": "lssar-ckpt", "model": _Planted(marker)}, run / "ckpt/latest.pt")
    with pytest.raises(ValueError, match=r"latest\.pt is corrupt \(it holds Python objects"):
        train(cfg, progress=False)
    assert main(["sample", str(run), "--which", "latest"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could run code" in err
    assert not marker.exists()
