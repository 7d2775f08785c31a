"""``lssar train --fsdp``: FSDP2 over ``torchrun`` ranks on CPU (gloo), sharded checkpoints.

Every multi-rank run is ``torchrun --nproc_per_node=2 -m lssar train`` in a subprocess, as a
user runs it. The reference is one uninterrupted 2-rank FSDP run (:func:`ref`); resumed runs
must equal it bit for bit (CPU, gloo: every reduction in the same order), DDP and one process
within float32 tolerance (the reductions' order differs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lssar import data
from lssar.cli import main
from lssar.train import fsdp, train
from lssar.train.config import load_config
from lssar.train.runs import load_run
from tests.train.tiny_runs import TINY, TRAIN_ON_2_RANKS, log_of

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed"),
]

# 2 ranks x batch_size 2 = one process's 4 rows; accumulation, a checkpoint every 2 steps, and
# activation checkpointing on (what it recomputes must not change a bit)
RUN = TINY | {"batch_size": 2, "grad_accum": 2, "ckpt_every": 2, "max_steps": 12}
FSDP = {"fsdp": True, "activation_checkpointing": True}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shakespeare-byte"
    return data.prepare("shakespeare", "byte", out, max_tokens=40_000, progress=False)


def _args(data_dir: Path, out: Path, name: str, **kw) -> list[str]:
    over = RUN | {"data_dir": data_dir, "out_dir": out, "run_name": name} | kw
    return ["--no-progress", *(f"--{k}={v}" for k, v in over.items())]


ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def _run(args: list[str]) -> None:
    cmd = [*TRAIN_ON_2_RANKS, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def weights(run: Path, which: str = "final") -> dict[str, torch.Tensor]:
    return load_run(run, which=which)[0].state_dict()


def assert_identical(a: Path, b: Path) -> None:
    """Runs ``a`` and ``b`` trained the same steps bit for bit: weights, losses, LRs, evals."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    keys = ("step", "loss", "lr", "tokens")
    assert [[r[k] for k in keys] for r in log_of(a)] == [[r[k] for k in keys] for r in log_of(b)]
    assert log_of(a, "eval") == log_of(b, "eval")


@pytest.fixture(scope="module")
def ref(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 2-rank FSDP run."""
    out = tmp_path_factory.mktemp("runs")
    _run(_args(data_dir, out, "ref", **FSDP))
    return out / "ref"


def test_fsdp_equals_ddp_and_one_process(ref: Path, data_dir: Path, tmp_path: Path) -> None:
    config = json.loads((ref / "config.json").read_text())
    assert config["train"]["fsdp"] and config["train"]["activation_checkpointing"]
    assert config["fsdp"] == {"world_size": 2, "param_dtype": "fp32", "reduce_dtype": "fp32"}
    assert (ref / "DONE").is_file() and not (ref / "ckpt/latest.pt").exists()
    _run(_args(data_dir, tmp_path, "ddp"))
    over = RUN | {"data_dir": str(data_dir), "out_dir": str(tmp_path), "batch_size": 4}
    one = train(load_config(None, over | {"run_name": "one"}), progress=False)
    w = weights(ref)
    for other in (tmp_path / "ddp", one):
        for k, v in weights(other).items():
            torch.testing.assert_close(w[k], v, atol=1e-5, rtol=1e-4, msg=k)
        for event, key in (("train", "loss"), ("eval", "val_loss")):
            for a, b in zip(log_of(ref, event), log_of(other, event), strict=True):
                assert a["step"] == b["step"] and a[key] == pytest.approx(b[key], abs=1e-5)
                assert a["tokens"] == b["tokens"]
    # the sharded checkpoint, gathered in one process, is the final model bit for bit
    latest = weights(ref, "latest")
    assert all(torch.equal(latest[k], v) for k, v in w.items())
    assert load_run(ref, which="latest")[2]["step"] == RUN["max_steps"]


def test_resume_is_bit_exact_and_on_one_rank_keeps_the_global_batch(
    ref: Path, data_dir: Path, tmp_path: Path
) -> None:
    args = _args(data_dir, tmp_path, "b", **FSDP)
    _run([*args, "--max_time_s=0"])  # stops (and checkpoints) after one step
    b = tmp_path / "b"
    assert not (b / "DONE").exists() and fsdp.pointer(b)["step"] == 1
    shutil.copytree(b, tmp_path / "c")
    _run(args)
    assert_identical(ref, b)
    # the same checkpoint resumed by one process: DCP reshards it; the global batch stays 4 rows
    over = RUN | FSDP | {"data_dir": str(data_dir), "out_dir": str(tmp_path), "run_name": "c"}
    with pytest.raises(ValueError, match=r"2 ranks x batch_size=2 = 4 rows.*--batch_size=4 keeps"):
        train(load_config(None, over), progress=False)
    c = train(load_config(None, over | {"batch_size": 4}), progress=False)
    assert json.loads((c / "env.json").read_text())["start_step"] == 1
    assert json.loads((c / "config.json").read_text())["fsdp"]["world_size"] == 1
    for k, v in weights(c).items():
        torch.testing.assert_close(weights(ref)[k], v, atol=1e-5, rtol=1e-4, msg=k)


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of ``torchrun``'s worker with ``RANK=rank`` (a descendant of ``agent``)."""
    todo, want = [agent], f"RANK={rank}".encode()
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if pid != agent and want in env:
            return pid
        todo += map(int, children)
    return None


@pytest.mark.slow  # two more torchrun launches (~1 min); the in-process kill below is quick
def test_a_killed_rank_leaves_a_whole_checkpoint_to_resume_from(
    ref: Path, data_dir: Path, tmp_path: Path
) -> None:
    args = _args(data_dir, tmp_path, "k", **FSDP)
    k = tmp_path / "k"
    proc = subprocess.Popen(
        [*TRAIN_ON_2_RANKS, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while (
            not (k / fsdp.POINTER).is_file()
            or json.loads((k / fsdp.POINTER).read_text())["step"] < 4
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint at step 4"
            time.sleep(0.02)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)  # mid-run: training, evaluating or saving
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, err[-2000:]
    assert not (k / "DONE").exists()
    meta = fsdp.pointer(k)  # names a complete checkpoint, readable in one process
    assert meta["step"] >= 4 and load_run(k, which="latest")[2]["step"] == meta["step"]
    _run(args)
    assert_identical(ref, k)


def test_an_interrupted_save_keeps_the_previous_checkpoint(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process (a group of one): a save killed after writing its shards but before its
    commit, then a superseded directory left behind; the run resumes from the last commit."""
    over = RUN | FSDP | {"data_dir": str(data_dir), "out_dir": str(tmp_path), "batch_size": 4}
    a = train(load_config(None, over | {"run_name": "a"}), progress=False)
    cfg = load_config(None, over | {"run_name": "b"})
    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def killed_at_step_6(state, *, checkpoint_id, **kw):
        real(state, checkpoint_id=checkpoint_id, **kw)
        if Path(checkpoint_id).name.startswith("step-00000006"):
            raise KeyboardInterrupt  # the kill: shards on disk, latest.json not yet replaced

    monkeypatch.setattr(dcp, "save", killed_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    monkeypatch.undo()
    b = tmp_path / "b"
    assert fsdp.pointer(b)["step"] == 4 and len(list((b / fsdp.SHARDS).iterdir())) == 2
    (b / fsdp.SHARDS / "step-00000002-dead").mkdir()  # a superseded save not yet deleted
    train(cfg, progress=False)
    assert [d.name[:13] for d in (b / fsdp.SHARDS).iterdir()] == ["step-00000012"]
    assert_identical(a, b)


def test_activation_checkpointing_changes_no_bit(data_dir: Path, tmp_path: Path) -> None:
    """Recomputed blocks, dropout included (the RNG state is replayed), train the same model."""
    over = RUN | {"data_dir": str(data_dir), "out_dir": str(tmp_path), "batch_size": 4}
    over |= {"max_steps": 4, "dropout": 0.1}
    plain = train(load_config(None, over | {"run_name": "plain"}), progress=False)
    cfg = load_config(None, over | {"run_name": "ac", "activation_checkpointing": True})
    assert_identical(plain, train(cfg, progress=False))
    # bookkeeping: a run may be resumed with it switched off (it changes memory, not results)
    assert train(dataclasses.replace(cfg, activation_checkpointing=False), progress=False)


def test_bf16_shards_compute_in_bf16(data_dir: Path, tmp_path: Path) -> None:
    over = RUN | FSDP | {"data_dir": str(data_dir), "out_dir": str(tmp_path), "batch_size": 4}
    run = train(load_config(None, over | {"max_steps": 2, "dtype": "bf16"}), progress=False)
    config = json.loads((run / "config.json").read_text())
    assert config["fsdp"]["param_dtype"] == "bf16" and config["autocast"] == "bf16"
    assert all(v.dtype == torch.float32 for v in weights(run).values())  # kept in fp32


@pytest.mark.parametrize("flag", ["--fsdp", "--activation_checkpointing"])
def test_unsupported_combinations_are_one_line_errors(flag: str, capsys) -> None:
    assert main(["train", flag, "--compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "with compile is not supported" in err and "--compile" in err
