"""Tests for lssar.train.checkpoint: the one run-directory and checkpoint format, used by a loop
over any nn.Module (model + optimizer + scheduler + data position), resumed after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from lssar.runio import LockedError
from lssar.train.checkpoint import (
    DONE,
    FINAL,
    LATEST,
    VERSION,
    load_checkpoint,
    open_run,
    read_log,
)
from lssar.train.schedule import set_lr, warmup_cosine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models; and a fork needs no pool

TOTAL = 12
DATA = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))


def fit(run_dir: Path, kill_at: int | None = None, config: dict | None = None) -> torch.Tensor:
    """A fine-tuning loop written as the module docstring says: a model, AdamW, a torch
    scheduler beside the step-function schedule, and a data position (an offset into DATA).
    ``kill_at`` SIGKILLs the process right after the checkpoint of that step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # holds state: last_epoch
    with open_run(run_dir, config or {"total": TOTAL, "model": "mlp"}) as run:
        if run.done is not None:
            model.load_state_dict(load_checkpoint(run_dir / FINAL)["model"])
            return model[0].weight.detach().clone()
        state = run.resume(model, opt, sched)
        step, pos = (0, 0) if state is None else (state["step"], state["data"]["pos"])
        run.start(step, env={"host": "test"})
        while step < TOTAL:
            set_lr(opt, warmup_cosine(step, total=TOTAL, peak=0.05, warmup=3, floor=0.005))
            x = DATA[pos : pos + 8]
            loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step, pos = step + 1, (pos + 8) % len(DATA)
            run.log(step=step, loss=loss.item())
            if step % 4 == 0:
                run.save(step, model, opt, sched, data={"pos": pos})
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        run.save(step, model, opt, sched, data={"pos": pos})
        run.finish(step=step, loss=loss.item())
    return model[0].weight.detach().clone()


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = fit(tmp_path / "whole")
    pid = os.fork()  # a child that trains and SIGKILLs itself (no new interpreter to start)
    if pid == 0:
        try:
            fit(tmp_path / "k", kill_at=8)
        finally:
            os._exit(1)  # reached only if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    run = tmp_path / "k"
    assert not (run / DONE).exists() and load_checkpoint(run / LATEST)["step"] == 8
    (run / "ckpt" / ".latest.pt.123.tmp").write_bytes(b"half a checkpoint")  # a killed write
    with open(run / "log.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # a torn last line
    assert torch.equal(fit(run), whole)
    assert not (run / "ckpt" / ".latest.pt.123.tmp").exists()
    assert [r["step"] for r in read_log(run)] == list(range(1, TOTAL + 1))
    assert json.loads((run / DONE).read_text())["step"] == TOTAL
    assert (run / FINAL).stat().st_ino == (run / LATEST).stat().st_ino  # one file, linked
    ckpt = load_checkpoint(run / FINAL)
    assert ckpt["version"] == VERSION and ckpt["scheduler"]["last_epoch"] == TOTAL
    assert json.loads((run / "env.json").read_text())["start_step"] == 8
    assert torch.equal(fit(run), whole)  # finished: read back, not trained again


def test_a_changed_config_is_refused_and_a_held_run_is_locked(tmp_path: Path) -> None:
    run = tmp_path / "r"
    fit(run)
    with pytest.raises(ValueError, match=r"total: 12 \(run\) != 13 \(now\)\): use another run"):
        fit(run, config={"total": 13, "model": "mlp"})
    with pytest.raises(ValueError, match=r"lr: \(absent\) \(run\) != 0.1"):
        fit(run, config={"total": 12, "model": "mlp", "lr": 0.1})
    with open_run(run, {"total": 12, "model": "mlp"}):
        with pytest.raises(LockedError, match="already locked by this process"):
            fit(run)
    with open_run(run, {"other": 1}, resume=False) as r:  # starting over: no check, no DONE
        assert r.done is None and r.resume() is None


def test_a_failed_start_leaves_no_directory(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with open_run(tmp_path / "new", {"a": 1}):
            raise RuntimeError("boom")
    assert not (tmp_path / "new").exists()


def test_checkpoint_versions(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    torch.save({"format": "lssar-ckpt", "step": 3}, path)  # before versions: read as 1
    assert load_checkpoint(path)["step"] == 3
    torch.save({"format": "lssar-ckpt", "version": VERSION + 1}, path)
    with pytest.raises(ValueError, match=f"format version {VERSION + 1}.*upgrade lssar"):
        load_checkpoint(path)
    torch.save({"step": 3}, path)
    with pytest.raises(ValueError, match="not an lssar checkpoint"):
        load_checkpoint(path)


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    fit(tmp_path / "r", kill_at=None)
    (tmp_path / "r" / DONE).unlink()
    with open_run(tmp_path / "r", {"total": TOTAL, "model": "mlp"}) as run:
        with pytest.raises(ValueError, match=r"latest\.pt does not fit this model .*start a new"):
            run.resume(torch.nn.Linear(3, 3))
        run.save(1, torch.nn.Linear(3, 3))  # no optimizer state
        with pytest.raises(ValueError, match="holds no optimizer state: start the run over"):
            run.resume(torch.nn.Linear(3, 3), torch.optim.SGD(torch.nn.Linear(3, 3).parameters()))
