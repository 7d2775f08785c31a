"""Tests for lssar.train: runs, exact resume, DDP equivalence, the CLIs, document masking (the
config is in test_config.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lssar import data
from lssar.cli import main
from lssar.train import sample, sample_cli, train
from lssar.train.config import TrainConfig, load_config
from lssar.train.runs import load_run
from tests.train.tiny_runs import TINY, TRAIN_ON_2_RANKS, log_of, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shakespeare-byte"
    return data.prepare("shakespeare", "byte", out, max_tokens=40_000, progress=False)


@pytest.fixture(scope="module")
def finished_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    return train(tiny(data_dir, out, max_steps=40, eval_every=20), progress=False)


# ------------------------------------------------------------------------------------- runs


def test_run_dir_and_loss_decreases(finished_run: Path) -> None:
    run = finished_run
    for name in ("config.json", "env.json", "log.jsonl", "ckpt/latest.pt", "ckpt/final.pt", "DONE"):
        assert (run / name).is_file(), name
    losses = [r["loss"] for r in log_of(run)]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    vals = [r["val_loss"] for r in log_of(run, "eval")]
    assert [r["step"] for r in log_of(run, "eval")] == [0, 20, 40] and vals[-1] < vals[0]
    assert json.loads((run / "config.json").read_text())["autocast"] == "fp32"  # dtype="fp32"
    env = json.loads((run / "env.json").read_text())
    assert env["world_size"] == 1 and env["torch"] == torch.__version__
    model, cfg, meta = load_run(run)
    assert not model.training and cfg.max_steps == 40 and meta["step"] == 40
    assert meta["tokenizer"] == "byte" and meta["val_history"][-1][1] == vals[-1]
    # a finished run is left alone
    before = (run / "log.jsonl").read_text()
    assert train(cfg, progress=False) == run and (run / "log.jsonl").read_text() == before


def test_resume_is_exact(data_dir: Path, tmp_path: Path) -> None:
    # dropout and gradient accumulation: their randomness and data must replay exactly too
    kw = dict(max_steps=8, dropout=0.1, grad_accum=2, dtype="auto")
    a = train(tiny(data_dir, tmp_path, run_name="a", **kw), progress=False)
    cfg_b = tiny(data_dir, tmp_path, run_name="b", **kw)
    b = train(dataclasses.replace(cfg_b, max_time_s=0.0), progress=False)  # stops after 1 step
    assert not (b / "DONE").exists() and [r["step"] for r in log_of(b)] == [1]
    train(cfg_b, progress=False, _stop_after=4)
    assert torch.load(b / "ckpt/latest.pt", weights_only=True)["step"] == 4
    train(cfg_b, progress=False)
    assert (b / "DONE").is_file()
    wa, wb = load_run(a)[0].state_dict(), load_run(b)[0].state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    la, lb = log_of(a), log_of(b)
    assert [r["step"] for r in lb] == list(range(1, 9))
    assert [(r["loss"], r["lr"], r["tokens"]) for r in la] == [
        (r["loss"], r["lr"], r["tokens"]) for r in lb
    ]
    assert log_of(a, "eval") == log_of(b, "eval")


def test_corrupt_checkpoint_and_config_mismatch(data_dir: Path, tmp_path: Path) -> None:
    cfg = tiny(data_dir, tmp_path, run_name="r")
    run = train(cfg, progress=False, _stop_after=2)
    with pytest.raises(ValueError, match=r"differ.*lr: 0\.01 \(run\) != 0\.02.*--run_name"):
        train(dataclasses.replace(cfg, lr=0.02), progress=False)
    train(dataclasses.replace(cfg, log_every=3, max_time_s=1e9), progress=False, _stop_after=3)
    (run / "config.json").unlink()  # without it only the checkpoint can tell the shapes differ
    with pytest.raises(ValueError, match=r"latest\.pt does not fit this model .*size mismatch"):
        train(dataclasses.replace(cfg, n_embd=64), progress=False)
    ckpt = run / "ckpt/latest.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"checkpoint .*latest\.pt is corrupt .*delete it"):
        train(cfg, progress=False)
    with pytest.raises(ValueError, match="corrupt"):
        load_run(run, which="latest")
    with pytest.raises(FileNotFoundError, match="not finished"):
        load_run(run)
    train(cfg, resume=False, progress=False)  # starts over instead
    assert load_run(run)[2]["step"] == 8 and [r["step"] for r in log_of(run)] == list(range(1, 9))


def test_bad_data_errors(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenized with 'byte'.*asks for 'gpt2'"):
        train(tiny(data_dir, tmp_path, tokenizer="gpt2"), progress=False)
    with pytest.raises(ValueError, match=r"val split .* has \d+ tokens, seq_len=3000 needs 3001"):
        train(tiny(data_dir, tmp_path, seq_len=3000, eval_tokens=3000), progress=False)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_ddp_matches_single_process(data_dir: Path, tmp_path: Path) -> None:
    over = TINY | {
        "data_dir": str(data_dir),
        "out_dir": str(tmp_path),
        "max_steps": 4,
        "grad_accum": 2,
        "eval_every": 2,
        "max_time_s": 1e9,  # exercises rank 0's stop broadcast
    }
    args = [f"--{k}={v}" for k, v in over.items()]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [
        *TRAIN_ON_2_RANKS,
        "--no-progress",
        "--run_name=ddp",
        *args,
        "--batch_size=2",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # batch_size is per rank: 2 ranks x 2 rows = the single process's 4 rows, the same windows
    single = train(load_config(None, over | {"run_name": "single"}), progress=False)
    ddp, one = load_run(tmp_path / "ddp"), load_run(single)
    assert ddp[2]["step"] == one[2]["step"] == 4 and ddp[2]["tokens"] == one[2]["tokens"]
    assert json.loads((tmp_path / "ddp/env.json").read_text())["world_size"] == 2
    wd, ws = ddp[0].state_dict(), one[0].state_dict()
    for k in ws:
        torch.testing.assert_close(wd[k], ws[k], atol=1e-5, rtol=1e-4, msg=k)
    for event, key in (("train", "loss"), ("eval", "val_loss")):
        for rd, rs in zip(log_of(tmp_path / "ddp", event), log_of(single, event), strict=True):
            assert rd["step"] == rs["step"] and rd[key] == pytest.approx(rs[key], abs=1e-5)


# -------------------------------------------------------------------------------------- CLI


def test_train_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--nonsense=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown config key 'nonsense'")
    assert main(["train", "--preset", "nope"]) == 2
    assert "tiny-cpu" in capsys.readouterr().err


def test_train_cli_runs(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = [f"--{k}={v}" for k, v in TINY.items() if k != "log_every"]
    code = main(
        [
            "train",
            "--no-progress",
            "--max_steps",
            "2",
            "--log-every=1",
            "--run_name=c",
            f"--data_dir={data_dir}",
            f"--out_dir={tmp_path}",
            *args,
        ]
    )
    assert code == 0 and (tmp_path / "c/DONE").is_file()
    assert (
        main(
            [
                "train",
                "--no-progress",
                "--max_steps",
                "2",
                "--log-every=1",
                "--run_name=c",
                f"--data_dir={data_dir}",
                f"--out_dir={tmp_path}",
                *args,
            ]
        )
        == 0
    )
    assert "complete" in capsys.readouterr().out


def test_sample(finished_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, _, meta = load_run(finished_run)
    tok = data.get_tokenizer(meta["tokenizer"])
    ids = sample(model, tok, "ROMEO:", 37, seed=1)
    assert len(ids) == 37 and all(0 <= i < 256 for i in ids)
    assert sample(model, tok, "ROMEO:", 37, seed=1) == ids  # seeded
    assert (
        sample_cli(
            [
                str(finished_run),
                "--prompt",
                "ROMEO:",
                "--max-new-tokens",
                "25",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    greedy = sample(model, tok, "ROMEO:", 25, temperature=0)
    assert out == "ROMEO:" + tok.decode(greedy) + "\n"
    assert (
        sample_cli([str(finished_run), "--max-new-tokens", "5", "--attn", "lssa", "--attn-p", "15"])
        == 0
    )
    assert main(["sample", str(finished_run), "--attn", "relu", "--attn-p", "2"]) == 2


def test_data_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"document {i}\n" * 200)
    out = tmp_path / "out"
    assert (
        main(
            [
                "data",
                "prepare",
                "--corpus",
                str(corpus),
                "--tokenizer",
                "byte",
                "--out",
                str(out),
                "--no-progress",
                "--val-fraction",
                "0.25",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    m = data.read_manifest(out)
    assert text.splitlines()[0] == str(out) and f"{m['total_tokens']:,} tokens" in text
    assert m["splits"]["val"]["tokens"] > 0


# ---------------------------------------------------------------------------- document masking


@pytest.fixture(scope="module")
def eot_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short documents (3-14 words) tokenized with a trained BPE, whose EOT is id 0: a
    32-token window holds several documents."""
    root = tmp_path_factory.mktemp("docs")
    g = torch.Generator().manual_seed(0)
    words = "the a king queen sword crown night day love death speak hear".split()
    for i in range(300):
        n = int(torch.randint(3, 15, (1,), generator=g))
        text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g))
        (root / f"d{i:03d}.txt").write_text(text)
    out = tmp_path_factory.mktemp("data") / "docs-bpe"
    return data.prepare(str(root), "bpe-300", out, progress=False)


def test_doc_mask_cuts_every_batch_at_eot_and_resumes_with_it(
    eot_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--doc-mask``: every training and validation forward gets the batch's EOT documents;
    config.json and the checkpoint record it, a resume must repeat it (here by the CLI flag);
    without it (the default) the forward is ``model(x, y)`` as before."""
    from lssar.model import GPT

    calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    real = GPT.forward

    def spy(self, idx, *args, **kwargs):
        calls.append((idx.clone(), kwargs.get("cu_seqlens")))
        return real(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", spy)
    kw = dict(tokenizer="bpe-300", max_steps=4, eval_every=2)
    cfg = tiny(eot_data_dir, tmp_path, doc_mask=True, run_name="d", **kw)
    run = train(cfg, progress=False, _stop_after=2)
    eot = data.read_manifest(eot_data_dir)["eot"]
    assert eot == 0 and calls
    for x, cu in calls:
        assert cu is not None and torch.equal(cu, data.eot_documents(x, eot))
    assert all(len(cu) > x.shape[0] + 1 for x, cu in calls)  # documents inside the rows
    assert json.loads((run / "config.json").read_text())["train"]["doc_mask"] is True
    assert load_run(run, which="latest")[1].doc_mask is True
    with pytest.raises(ValueError, match=r"doc_mask: True \(run\) != False \(now\)"):
        train(dataclasses.replace(cfg, doc_mask=False), progress=False)
    calls.clear()
    flags = [f"--{k}={v}" for k, v in (TINY | kw).items()]
    where = [f"--data_dir={eot_data_dir}", f"--out_dir={tmp_path}", "--run_name=d"]
    assert main(["train", "--no-progress", "--doc-mask", *where, *flags]) == 0
    assert (run / "DONE").is_file() and load_run(run)[2]["step"] == 4
    assert calls and all(cu is not None for _, cu in calls)
    calls.clear()
    off = train(dataclasses.replace(cfg, doc_mask=False, run_name="off"), progress=False)
    assert calls and all(cu is None for _, cu in calls)
    assert json.loads((off / "config.json").read_text())["train"]["doc_mask"] is False


def test_doc_mask_default_and_impl_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run from before ``doc_mask`` resumes as off; an impl that cannot take packed
    documents is refused before anything runs."""
    from lssar.ops import registry
    from lssar.train.runs import check_same_config

    cfg = TrainConfig()
    old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "doc_mask"}
    check_same_config(old, cfg, tmp_path)
    with pytest.raises(ValueError, match=r"doc_mask: False \(run\) != True \(now\)"):
        check_same_config(old, dataclasses.replace(cfg, doc_mask=True), tmp_path)
    no_spans = dataclasses.replace(registry.BACKENDS["chunked"], spans=False)
    monkeypatch.setitem(registry.BACKENDS, "chunked", no_spans)
    monkeypatch.setitem(registry.IMPLS, "chunked", no_spans)
    over = ["--doc_mask=true", "--tokenizer=gpt2", "--attn=lssa", "--attn_impl=chunked"]
    with pytest.raises(ValueError, match=r"attn_impl='chunked' does not: use auto or one of"):
        load_config(None, over)
