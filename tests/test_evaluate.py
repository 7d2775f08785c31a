"""Evaluation (loss vs length, diagnostics, passkey) and the reproduce report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lssar import data, evaluate, reproduce
from lssar.cli import main as cli_main
from lssar.config import load_config
from lssar.runs import load_run
from lssar.train import train

TINY = dict(
    n_layer=2,
    n_head=2,
    n_embd=32,
    seq_len=16,
    batch_size=4,
    eval_tokens=128,
    warmup_steps=2,
    lr=1e-2,
    min_lr=1e-3,
    dtype="fp32",
    log_every=5,
    eval_every=10,
    ckpt_every=100,
    max_steps=10,
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    data_dir = data.prepare("shakespeare", "byte", root / "data", max_tokens=60_000, progress=False)
    out = {}
    for attn in ("lssa", "softmax"):
        cfg = load_config(
            None,
            TINY
            | {
                "attn": attn,
                "data_dir": str(data_dir),
                "out_dir": str(root / "runs"),
                "run_name": attn,
            },
        )
        out[attn] = train(cfg, progress=False)
    return out


def test_evaluate_run_writes_results_and_reuses_them(runs):
    r = evaluate.evaluate_run(runs["lssa"], [1, 2, 4, 16], eval_tokens=512, progress=False)
    assert list(r["loss"]) == ["16", "32", "64", "256"]
    assert r["tokens_per_length"] == 512 and all(np.isfinite(list(r["loss"].values())))
    assert len(r["loss_by_position"]) == evaluate.N_POSITION_BUCKETS
    assert set(r["diagnostics"]) == {"16", "32", "64", "256"}
    d = r["diagnostics"]["256"]
    assert len(d["entropy"]) == 2 and all(0 <= s <= 1 for s in d["sink"])
    h = r["numerical_health"]
    assert h["length"] == 256 and h["bf16"]["nonfinite_logits"] == 0
    out = runs["lssa"] / "eval" / "lssa"
    for name in (
        "results.json",
        "results.md",
        "loss_vs_length.png",
        "loss_by_position.png",
        "entropy_sink_vs_length.png",
    ):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["loss"] == r["loss"]
    before = (out / "results.json").stat().st_mtime_ns
    again = evaluate.evaluate_run(runs["lssa"], [1, 2, 4, 16], eval_tokens=512, progress=False)
    assert again == r and (out / "results.json").stat().st_mtime_ns == before


def test_fine_tuning_free_reweighting_override(runs):
    base = evaluate.evaluate_run(
        runs["lssa"], [1, 2], eval_tokens=256, diagnostics=False, health=False, progress=False
    )
    sharp = evaluate.evaluate_run(
        runs["lssa"],
        [1, 2],
        attn="lssar",
        attn_p=15.0,
        eval_tokens=256,
        diagnostics=False,
        health=False,
        progress=False,
    )
    assert sharp["trained_attention"] == "lssa" and sharp["evaluated_attention"] == "lssar p=15"
    assert sharp["loss"] != base["loss"]
    assert (runs["lssa"] / "eval" / "lssar_p15" / "results.json").exists()
    with pytest.raises(ValueError, match="cannot evaluate this run with attention 'ssmax'"):
        evaluate.evaluate_run(runs["lssa"], [1], attn="ssmax", progress=False)


def test_bad_input(runs, tmp_path, capsys):
    for bad in ("0,2", "1,a", ""):
        with pytest.raises(ValueError, match="positive"):
            evaluate.parse_multiples(bad)
    with pytest.raises(ValueError, match="tokens; .* are needed"):
        evaluate.evaluate_run(runs["softmax"], [1, 16], eval_tokens=10**7, progress=False)
    with pytest.raises(ValueError, match="too short for a passkey probe"):
        evaluate.evaluate_run(runs["softmax"], [1], eval_tokens=64, passkey=True, progress=False)
    assert cli_main(["eval", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_passkey_probe_construction_and_scoring(runs):
    tok = data.get_tokenizer("byte")
    filler = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, dtype=np.uint8)
    rng = np.random.default_rng(0)
    ids, answer = evaluate.passkey_sample(tok, filler, 200, 0.5, "48213", rng)
    text = tok.decode(ids)
    assert len(ids) == 200 and text.endswith(evaluate.QUESTION + "48213")
    assert "The pass key is 48213." in text and tok.decode(ids[answer:]) == "48213"
    model, _, _ = load_run(runs["softmax"])
    tuned = evaluate.passkey_finetune(model, tok, filler, 96, steps=2, batch_size=2, progress=False)
    acc = evaluate.passkey_accuracy(tuned, tok, filler, [96, 192], [0.1, 0.9], trials=2)
    assert set(acc) == {"96", "192"} and set(acc["96"]) == {"0.1", "0.9"}
    assert all(0.0 <= a <= 1.0 for row in acc.values() for a in row.values())


def _fake(label_train, label_eval, losses, train_len=16):
    return {
        "run": "runs/x/y",
        "trained_attention": label_train,
        "evaluated_attention": label_eval,
        "train_len": train_len,
        "tokens_per_length": 512,
        "loss": {str(m * train_len): v for m, v in zip([1, 2, 4, 8, 16], losses)},
        "loss_by_position": [1.0] * 32,
        "config": {"n_layer": 2},
        "env": {},
    }


def test_report_states_claims_from_the_numbers(tmp_path):
    results = [
        _fake("softmax", "softmax", [3.2, 4.2, 5.5, 6.3, 7.0]),
        _fake("lssa", "lssa", [3.2, 4.1, 5.3, 5.9, 6.2]),
        _fake("lssa", "lssar p=15", [3.3, 3.3, 3.4, 3.5, 3.5]),
        _fake("lssar p=15", "lssar p=15", [3.2, 3.2, 3.2, 3.3, 3.3]),
    ]
    out = reproduce.write_report("quick", reproduce.PRESETS["quick"], results, tmp_path / "r", 1.0)
    text = (out / "REPORT.md").read_text()
    assert "measured x1.03 -> **supported**" in text  # LSSAR flat
    assert "measured x2.19 -> **supported**" in text  # softmax blows up
    assert "3.300 vs 7.000 -> **supported**" in text
    assert "lssa -> lssar p=15 (eval only)" in text and "| 3.200 | 4.200 | 5.500 |" in text
    assert (out / "loss_vs_length.png").exists() and json.loads((out / "results.json").read_text())
    flipped = [
        _fake("softmax", "softmax", [3.2, 3.2, 3.3, 3.3, 3.3]),
        _fake("lssar p=15", "lssar p=15", [3.2, 4.0, 5.0, 6.0, 7.0]),
    ]
    text = (
        reproduce.write_report("quick", reproduce.PRESETS["quick"], flipped, tmp_path / "f", 1.0)
        / "REPORT.md"
    ).read_text()
    assert "**not supported**" in text and "**contradicted**" in text


def test_reproduce_rejects_unknown_preset_and_prints_the_paper_plan(capsys):
    assert cli_main(["reproduce", "--preset", "huge"]) == 2
    assert "choose from quick, cpu, paper" in capsys.readouterr().err
    assert cli_main(["reproduce", "--preset", "paper"]) == 0
    plan = capsys.readouterr().out
    assert plan.count("torchrun --standalone --nproc_per_node=8 -m lssar train") == 9
    assert "--preset gpt2-124m-fineweb --attn=lssar --attn_p=15" in plan
