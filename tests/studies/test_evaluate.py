"""Evaluation (loss vs length, diagnostics, passkey) and the reproduce report."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from lssar import data
from lssar.cli import main as cli_main
from lssar.data import passkey
from lssar.ops.variants import VARIANTS
from lssar.spec import AttentionSpec
from lssar.studies import common
from lssar.studies.labels import label_of
from lssar.studies.lm import evaluate, presets, verdicts
from lssar.studies.lm import passkey as pk
from lssar.studies.lm import report as reproduce_report
from lssar.studies.lm import study as lm_study
from lssar.train import train
from lssar.train.config import load_config
from lssar.train.runs import load_run

ROOT = Path(__file__).resolve().parents[2]
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
    for name, attn, pos in (
        ("lssa", "lssa", "rope"),
        ("softmax", "softmax", "rope"),
        ("softmax-alibi", "softmax", "alibi"),
    ):
        cfg = load_config(
            None,
            TINY
            | {
                "attn": attn,
                "pos": pos,
                "data_dir": str(data_dir),
                "out_dir": str(root / "runs"),
                "run_name": name,
            },
        )
        out[name] = train(cfg, progress=False)
    return out


def test_evaluate_run_writes_results_and_reuses_them(runs):
    r = evaluate.evaluate_run(runs["lssa"], [1, 2, 4, 16], eval_tokens=512, progress=False)
    assert list(r["loss"]) == ["16", "32", "64", "256"]
    assert r["tokens_per_length"] == 512 and all(np.isfinite(list(r["loss"].values())))
    assert len(r["loss_by_position"]) == evaluate.N_POSITION_BUCKETS
    assert r["windows_per_length"] == {"16": 32, "32": 16, "64": 8, "256": 2}
    assert set(r["diagnostics"]) == {"16", "32", "64", "256"}
    d = r["diagnostics"]["256"]
    assert len(d["entropy"]) == 2 and all(0 <= s <= 1 for s in d["sink"])
    assert d["windows"] == 8  # the default, spread over the split
    # uniform attention over 1..256 causal keys: mean ln N and mean 1/N
    assert d["uniform_entropy"] == pytest.approx(np.mean(np.log(np.arange(1, 257))))
    assert d["uniform_sink"] == pytest.approx(np.mean(1 / np.arange(1, 257)))
    # the rows past the training length (16) alone: N_i = 17..256; none at 1x
    assert len(d["entropy_beyond"]) == 2 and all(0 <= s <= 1 for s in d["sink_beyond"])
    assert d["uniform_entropy_beyond"] == pytest.approx(np.mean(np.log(np.arange(17, 257))))
    assert d["uniform_sink_beyond"] == pytest.approx(np.mean(1 / np.arange(17, 257)))
    assert r["diagnostics"]["16"]["entropy_beyond"] is None
    # the profile along the window: 16 bins of 16 rows, the first one's uniform entropy ln 1..16
    assert d["row_bins"][:2] == [[0, 16], [16, 32]] and len(d["entropy_by_row"]) == 16
    assert d["uniform_entropy_by_row"][0] == pytest.approx(np.mean(np.log(np.arange(1, 17))))
    # the row mean is the mean of the profile (equal bins), beyond L the mean of bins 2..16
    assert np.mean(d["entropy"]) == pytest.approx(np.mean(d["entropy_by_row"]))
    assert np.mean(d["entropy_beyond"]) == pytest.approx(np.mean(d["entropy_by_row"][1:]))
    # provenance: the run's environment and this evaluation's, and the evaluation code's version
    assert r["env"]["git_sha"] == r["eval_env"]["git_sha"] and "git_dirty" in r["eval_env"]
    assert r["eval_version"] == evaluate.eval_code_version() and len(r["eval_version"]) == 12
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


def test_cached_evaluation_is_recomputed_when_the_evaluation_code_changes(runs, monkeypatch):
    kw = dict(eval_tokens=256, diagnostics=False, health=False, progress=False)
    r = evaluate.evaluate_run(runs["softmax"], [1, 2], **kw)
    monkeypatch.setattr(evaluate, "eval_code_version", lambda: "0123456789ab")
    again = evaluate.evaluate_run(runs["softmax"], [1, 2], **kw)
    assert again["eval_version"] == "0123456789ab" != r["eval_version"]
    assert again["loss"] == r["loss"]  # recomputed, and the same numbers


def test_a_retrained_run_is_evaluated_again_not_read_from_the_cache(runs, tmp_path):
    """Retrained with --no-resume and another seed (or lr): the same run dir and step, another
    model; its cached evaluation is the old model's and must not be returned."""
    cfg = dataclasses.replace(load_run(runs["softmax"])[1], out_dir=str(tmp_path), run_name="re")
    run = train(cfg, progress=False)
    kw = dict(eval_tokens=256, diagnostics=False, health=False, progress=False)
    first = evaluate.evaluate_run(run, [1, 2], **kw)
    assert evaluate.evaluate_run(run, [1, 2], **kw) == first  # unchanged: reused
    for change in ({"seed": 1}, {"lr": 5e-3}):
        train(dataclasses.replace(cfg, **change), resume=False, progress=False)
        again = evaluate.evaluate_run(run, [1, 2], **kw)
        assert again["step"] == first["step"] and again["config"] != first["config"]
        assert again["loss"] != first["loss"]
        assert again["cache_key"]["checkpoint_sha256"] != first["cache_key"]["checkpoint_sha256"]
        first = again


def test_eval_tag_and_folder_stay_inside_the_run(runs, capsys):
    kw = dict(eval_tokens=256, diagnostics=False, health=False, progress=False)
    for tag in ("../escaped", "/tmp/escaped", ".."):
        with pytest.raises(ValueError, match=r"--tag=.* must be a plain name"):
            evaluate.evaluate_run(runs["softmax"], [1], tag=tag, **kw)
    with pytest.raises(ValueError, match=r"folder='\.\./x' must be a plain name"):
        evaluate.evaluate_run(runs["softmax"], [1], folder="../x", **kw)
    assert not (runs["softmax"] / "escaped").exists()
    assert not (runs["softmax"].parent / "escaped").exists()
    assert cli_main(["eval", str(runs["softmax"]), "--tag", "../escaped"]) == 2
    assert "must be a plain name" in capsys.readouterr().err


def test_uniform_attention_matches_the_uniform_baseline(runs):
    """With q = k = 0 softmax attends uniformly: entropy and first-token mass equal the printed
    uniform values, for full causal attention and for a sliding window."""
    model, _, meta = load_run(runs["softmax"])
    for block in model.blocks:  # zero the q and k rows of the fused projection
        block.attn.qkv.weight.data[: 2 * model.cfg.n_embd] = 0
    val = data.load_split(meta["data_dir"], "val")
    for window in (None, 5):
        d = evaluate.attention_diagnostics(model, val, [16, 48], n_windows=3, window=window)
        for t in ("16", "48"):
            assert d[t]["windows"] == 3
            assert np.allclose(d[t]["entropy"], d[t]["uniform_entropy"], atol=1e-5)
            assert np.allclose(d[t]["sink"], d[t]["uniform_sink"], atol=1e-6)
            by_row = d[t]["entropy_by_row"], d[t]["uniform_entropy_by_row"]
            assert np.allclose(*by_row, atol=1e-5)
            assert np.allclose(d[t]["sink_by_row"], d[t]["uniform_sink_by_row"], atol=1e-6)
        far = d["48"]
        assert np.allclose(far["entropy_beyond"], far["uniform_entropy_beyond"], atol=1e-5)
        assert np.allclose(far["sink_beyond"], far["uniform_sink_beyond"], atol=1e-6)
    assert d["48"]["uniform_entropy"] == pytest.approx(
        np.mean(np.log(np.minimum(np.arange(1, 49), 5)))
    )


def test_sliding_window_control(runs):
    """Window = training length: identical to full attention at 1x (the causal mask already
    limits every row to L keys), different beyond it; its own tag and label."""
    kw = dict(eval_tokens=256, diagnostics=False, health=False, progress=False)
    full = evaluate.evaluate_run(runs["softmax"], [1, 4], **kw)
    win = evaluate.evaluate_run(runs["softmax"], [1, 4], window=16, **kw)
    assert win["loss"]["16"] == pytest.approx(full["loss"]["16"], abs=1e-6)
    assert win["loss"]["64"] != pytest.approx(full["loss"]["64"], abs=1e-4)
    assert win["tag"] == "softmax_window16" and win["window"] == 16
    assert (runs["softmax"] / "eval" / "softmax_window16" / "results.json").exists()
    assert evaluate.label_of(win) == "softmax, sliding window 16"
    with pytest.raises(ValueError, match="window must be a positive"):
        evaluate.evaluate_run(runs["softmax"], [1], window=0, **kw)


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


def test_rope_scaling_at_evaluation_is_labelled_and_cached_apart(runs):
    """YaRN with factor auto is the trained model at 1x (s = 1) and another beyond; a fixed
    factor is another evaluation (its own tag, label and cached result)."""
    kw = dict(eval_tokens=256, diagnostics=False, health=False, progress=False)
    plain = evaluate.evaluate_run(runs["softmax"], [1, 4], **kw)
    auto = evaluate.evaluate_run(runs["softmax"], [1, 4], rope_scaling="yarn", **kw)
    x4 = evaluate.evaluate_run(runs["softmax"], [1, 4], rope_scaling="yarn", rope_factor=4, **kw)
    assert auto["loss"]["16"] == plain["loss"]["16"]  # auto at 1x: s = 1, the trained RoPE
    assert auto["loss"]["64"] != plain["loss"]["64"]
    assert x4["loss"]["16"] != plain["loss"]["16"] and x4["loss"]["64"] == auto["loss"]["64"]
    assert (auto["tag"], x4["tag"]) == ("softmax_yarn_auto", "softmax_yarn_x4")
    assert evaluate.label_of(auto) == "softmax -> yarn auto (eval only)"
    assert evaluate.label_of(x4) == "softmax -> yarn x4 (eval only)"
    assert auto["rope_scaling"] == "yarn auto" and plain["rope_scaling"] is None
    for r in (plain, auto, x4):  # three results on disk, none overwriting another
        saved = runs["softmax"] / "eval" / r["tag"] / "results.json"
        assert json.loads(saved.read_text())["loss"] == r["loss"]


def test_alibi_run_is_labelled_with_its_positions(runs):
    kw = dict(eval_tokens=256, diagnostics=False, health=False, progress=False)
    r = evaluate.evaluate_run(runs["softmax-alibi"], [1, 4], **kw)
    assert r["trained_attention"] == r["evaluated_attention"] == "softmax + alibi"
    assert evaluate.label_of(r) == "softmax + alibi" and np.isfinite(r["loss"]["64"])
    with pytest.raises(ValueError, match="rescales RoPE; this model was trained with pos='alibi'"):
        evaluate.evaluate_run(runs["softmax-alibi"], [1], rope_scaling="yarn", **kw)


def test_bad_input(runs, tmp_path, capsys):
    for bad in ("0,2", "1,a", ""):
        with pytest.raises(ValueError, match="positive"):
            evaluate.parse_multiples(bad)
    with pytest.raises(ValueError, match="tokens; .* are needed"):
        evaluate.evaluate_run(runs["softmax"], [1, 16], eval_tokens=10**7, progress=False)
    with pytest.raises(ValueError, match="too short for a passkey probe"):
        evaluate.evaluate_run(
            runs["softmax"], [1], eval_tokens=64, passkey=pk.PasskeySettings(), progress=False
        )
    assert cli_main(["eval", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = str(runs["softmax"])
    for flags, match in (
        (["--rope-scaling=pi"], "unknown --rope-scaling 'pi'; choose one of: linear, ntk, "),
        (["--rope-scaling=yarn", "--rope-factor=0"], "--rope-factor must be a number > 0"),
        (["--rope-factor=2"], "--rope-factor needs --rope-scaling"),
        # once accepted, then NaN losses / an OverflowError traceback
        (["--rope-scaling=linear", "--rope-factor=1e-45"], "--rope-factor 1e-45 gives RoPE"),
        (["--rope-scaling=ntk", "--rope-factor=1e300"], "--rope-factor 1e+300 gives RoPE"),
    ):
        assert cli_main(["eval", run, "--lengths=1", "--tokens=32", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and match in err and err.count("\n") == 1, err


def test_passkey_probe_construction_and_scoring(runs):
    tok = data.get_tokenizer("byte")
    filler = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, dtype=np.uint8)
    rng = np.random.default_rng(0)
    ids, answer = passkey.passkey_sample(tok, filler, 200, 0.5, "48213", rng)
    text = tok.decode(ids)
    assert len(ids) == 200 and text.endswith(passkey.QUESTION + "48213")
    assert "The pass key is 48213." in text and tok.decode(ids[answer:]) == "48213"
    # the same probe from the same rng, and where its key sits (here: the space before it)
    again, answer2, key_at = passkey.passkey_sample_at(
        tok, filler, 200, 0.5, "48213", np.random.default_rng(0)
    )
    assert (again, answer2) == (ids, answer) and tok.decode(ids[key_at : key_at + 6]) == " 48213"
    model, _, _ = load_run(runs["softmax"])
    few = pk.PasskeySettings(steps=3, warmup_steps=1, batch_size=2)
    tuned, fit = pk.passkey_finetune(model, tok, filler, 96, few, progress=False)
    assert fit["steps"] == 3 and fit["reached"] == (fit["check_accuracy"] >= 0.9)
    # a fixed budget: every step runs even when the target (0 here) is met from the start
    met = pk.PasskeySettings(steps=4, warmup_steps=2, target=0.0, batch_size=2)
    _, fit = pk.passkey_finetune(model, tok, filler, 96, met, progress=False)
    assert fit["steps"] == 4 and fit["reached"]
    scores = pk.passkey_scores(tuned, tok, filler, [96, 192], [0.1, 0.9], trials=2, train_len=96)
    acc, split = scores["accuracy"], scores["by_distance"]
    assert set(acc) == {"96", "192"} and set(acc["96"]) == {"0.1", "0.9"}
    assert all(0.0 <= a <= 1.0 for row in acc.values() for a in row.values())
    # at 1x every key is within L; at 2x depth 0.1 puts it ~160 tokens back (beyond 96), depth
    # 0.9 ~70 (within): the buckets hold exactly those probes and their hits
    assert split["96"] == {"within": {"hits": round(2 * sum(acc["96"].values())), "n": 4},
                           "beyond": {"hits": 0, "n": 0}}  # fmt: skip
    assert split["192"]["within"] == {"hits": round(2 * acc["192"]["0.9"]), "n": 2}
    assert split["192"]["beyond"] == {"hits": round(2 * acc["192"]["0.1"]), "n": 2}
    x, starts, keys = pk._passkey_batch(tok, filler, 96, 3, rng, digits=2)
    for row, a in zip(x, starts):
        assert len(tok.decode(row[a:].tolist())) == 2 and tok.decode(row[a:].tolist()).isdigit()


def test_passkey_chance_and_schedule():
    """One-digit keys are 1-9: chance 1/9, not 1/10; the learning rate warms up, then decays."""
    tok = data.get_tokenizer("byte")
    filler = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, dtype=np.uint8)
    x, starts, _ = pk._passkey_batch(tok, filler, 80, 200, np.random.default_rng(0), digits=1)
    keys = {tok.decode(row[a:].tolist()) for row, a in zip(x, starts)}
    assert keys == {str(k) for k in range(1, 10)}
    assert pk.PasskeySettings(digits=1).chance == pytest.approx(1 / 9)
    assert pk.PasskeySettings(digits=3).chance == pytest.approx(1 / 900)
    s = pk.PasskeySettings(steps=100, warmup_steps=10, lr=1e-3)
    lrs = [s.lr_at(i) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10])) and max(lrs) == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] > 1e-4 > lrs[-1] - 1e-5
    with pytest.raises(ValueError, match="warmup_steps <= steps"):
        pk.PasskeySettings(steps=5, warmup_steps=6)


def _fake(train, evaluated, losses, seed=0, window=None, dirty=False, train_len=16):
    env = {"git_sha": "a" * 40, "git_dirty": dirty}
    return {
        "run": f"runs/x/{train}-s{seed}",
        "tag": evaluated.replace(" ", "_"),
        "trained_attention": train,
        "evaluated_attention": evaluated,
        "window": window,
        "train_len": train_len,
        "tokens_per_length": 512,
        "windows_per_length": {
            str(m * train_len): 512 // (m * train_len) for m in (1, 2, 4, 8, 16)
        },
        "loss": {str(m * train_len): v for m, v in zip([1, 2, 4, 8, 16], losses)},
        "loss_by_position": [1.0] * 32,
        "config": {"n_layer": 2, "seed": seed},
        "env": env,
        "eval_env": {"git_sha": "b" * 40, "git_dirty": False},
        "eval_version": "0123456789ab",
    }


SEED_NOISE = (0.0, 0.01, -0.01)  # the same shift for every arm of a seed: paired differences


def _arm(train, evaluated, losses, jitter=0.0, **kw):
    """Three seeds of one arm: seed i adds SEED_NOISE[i] (+ i * jitter) to every length."""
    return [
        _fake(train, evaluated, [x + n + i * jitter for x in losses], seed=i, **kw)
        for i, n in enumerate(SEED_NOISE)
    ]


@pytest.fixture
def clean_env(monkeypatch):
    """The report's own environment, as a clean checkout at commit ccc... would give it."""
    env = {"git_sha": "c" * 40, "git_dirty": False, "argv": ["lssar", "reproduce"]}
    monkeypatch.setattr(reproduce_report, "environment", lambda: dict(env))
    return env


def _report(tmp_path, results, name="r", preset="cpu"):
    out = reproduce_report.write_report(
        preset, presets.PRESETS[preset], results, tmp_path / name, 1.0
    )
    return (out / "REPORT.md").read_text()


def test_report_verdicts_from_intervals(tmp_path, clean_env):
    soft = [1.9, 2.0, 2.2, 2.5, 2.9]  # x1.53 at 16x
    results = [
        *_arm("softmax", "softmax", soft),
        *_arm("softmax", "softmax", [1.9, 2.0, 2.05, 2.1, 2.12], window=16),
        *_arm("lssa", "lssa", [1.93, 2.3, 2.6, 2.8, 3.0]),
        # eval-only p=15: worse than lssa by 0.5 +- a lot: the seeds disagree -> within noise
        *_arm("lssa", "lssar p=15", [2.43, 2.8, 3.1, 3.3, 3.5], jitter=-0.6),
        *_arm("lssar p=15", "lssar p=15", [1.935, 1.94, 1.99, 2.1, 2.3]),
        *_arm("softmax-qknorm-logn", "softmax-qknorm-logn", [1.9, 1.91, 1.99, 2.12, 2.3]),
        # the decomposition arm with the scale frozen at the training length (16)
        *_arm("softmax-qknorm-const n=16", "softmax-qknorm-const n=16", [1.9, 2.0, 2.1, 2.2, 2.3]),
    ]
    text = _report(tmp_path, results)
    assert text.startswith("# lssar reproduce --preset cpu\n\nBuilt from committed code")
    assert "Training runs at commit aaaaaaaaaa (15 runs)" in text  # windows/eval-only reuse runs
    # each decomposition row names what differs; the constant-scale arm is found with its n
    assert (
        "| + ln N scale given QK-norm (ln N_i instead of the fixed ln L) | softmax-qknorm-logn - "
        "softmax-qknorm-const n=16 | +0.000 ± 0.000 within noise | -0.090 ± 0.000 lower |"
    ) in text
    assert "| + QK-norm and ln N scale (two changes) | softmax-qknorm-logn - softmax |" in text
    assert "evaluations at bbbbbbbbbb; this report at cccccccccc." in text
    assert '"argv": [\n  "lssar",\n  "reproduce"\n ]' in text  # its own invocation's environment
    # flat: 2.3 / 1.935 = 1.19 on every seed (same shift) -> tight interval above 1.10; the
    # absolute excess 2.3 - 1.935 beside it
    assert (
        "stays nearly flat to 16x (paper x1.04): 16x / 1x**: measured 1.19 ± 0.00 (16x - 1x = "
        "+0.365 ± 0.000 nats per token) -> **contradicted**"
    ) in text
    assert (
        "16x / 1x**: measured 1.53 ± 0.01 (16x - 1x = +1.000 ± 0.000 nats per token) -> "
        "**supported** (criterion >= 1.5; p = 0.0037; unchanged by Holm over the 9 declared "
        "claims)"
    ) in text
    assert "| 16x / 1x | 16x - 1x |" in text and "| 1.53 ± 0.01 | +1.000 ± 0.000 |" in text
    # the paper's table carries its sources' caveats (docs/method.md section 7)
    assert reproduce_report.PAPER_CAVEAT in text
    assert "lssar p=15 - softmax**: measured -0.600 ± 0.000 -> **supported**" in text
    # 1.935 vs 1.9: +1.8% on every seed (inside +-2%): equivalent by TOST
    assert (
        "lssar / softmax - 1**: measured 0.018 ± 0.000 -> **supported** (equivalence within "
        "±2%, TOST; p = 0.00063;"
    ) in text
    assert (
        "lssa -> lssar p=15 (eval only) - lssa at 16x**: measured -0.100 ± 1.490 -> "
        "**within noise**"
    ) in text
    # LSSAR vs the strongest baseline: identical at 16x, an interval touching 0 is not "< 0"
    assert "lssar p=15 - softmax-qknorm-logn**: measured 0.000 ± 0.000 -> **within noise**" in text
    # the window control is better than LSSAR at 16x: contradicted, and the report says so
    assert (
        "lssar p=15 - sliding-window softmax**: measured 0.180 ± 0.000 -> **contradicted**" in text
    )
    assert (
        "does **not** show that LSSAR uses context beyond the training length: attending "
        "to the last L tokens only does better."
    ) in text
    assert (
        "| LSSAR vs the sliding-window control | lssar p=15 - softmax, sliding window 16 |" in text
    )
    assert (
        "| + re-weighting p=15 on LSSA (trained) | lssar p=15 - lssa | +0.005 ± 0.000 higher |"
        in text
    )
    assert "## Every arm against softmax (exploratory)" in text
    assert "## Every arm against LSSAR p=15 (exploratory)" in text
    assert "Scored tokens per length and seed: 512, in 32 / 16 / 8 / 4 / 2 windows" in text
    # sd 0.01, t(2) = 4.303: 4.303 * .01 / sqrt 3
    assert "| softmax | 3 x 512 | 1.900 ± 0.025 |" in text
    for png in ("loss_vs_length", "loss_by_position"):
        assert (tmp_path / "r" / f"{png}.png").stat().st_size > 0
    summary = json.loads((tmp_path / "r" / "results.json").read_text())["summary"]
    assert summary["softmax"]["16"]["n"] == 3


def _holm_and_window_results(window_jitter: float):
    """softmax, its window control and LSSAR p=15, 3 seeds: "LSSAR beats softmax at 16x" has
    per-seed differences -0.15, -0.20, -0.25 (paired t p = 0.020: supported alone, not after
    Holm over the 5 declared claims); LSSAR - window at 16x is -0.005 - i * window_jitter."""
    soft = _arm("softmax", "softmax", [1.9, 2.0, 2.2, 2.5, 2.9])
    for r, extra in zip(soft, (-0.05, 0.0, 0.05)):
        r["loss"]["256"] += extra
    return [
        *soft,
        *_arm("softmax", "softmax", [1.9] * 4 + [2.705], window=16, jitter=window_jitter),
        *_arm("lssar p=15", "lssar p=15", [1.935, 1.94, 1.99, 2.1, 2.7]),
    ]


def test_report_holm_changes_a_verdict_and_ties_only_from_tost(tmp_path, clean_env):
    text = _report(tmp_path, _holm_and_window_results(0.002))
    assert (
        "LSSAR beats softmax at 16x: lssar p=15 - softmax**: measured -0.200 ± 0.124 -> "
        "**within noise** (criterion < 0; p = 0.02; **Holm changes it** (raw: supported) over "
        "the 5 declared claims)."
    ) in text
    # the flat-loss claim is far beyond its bound: Holm keeps it
    assert "-> **contradicted** (criterion <= 1.10; p < 0.0001; unchanged by Holm" in text
    # LSSAR - window: -0.005, -0.007, -0.009 (p = 0.026: below the window only before Holm);
    # its 90% interval lies inside +-0.02: a tie, by TOST
    assert (
        "sliding-window softmax**: measured -0.007 ± 0.005 -> **within noise** (criterion < 0; "
        "p = 0.026; **Holm changes it** (raw: supported)"
    ) in text
    assert (
        "attending to the last L tokens only does as well: equivalent within ±0.02 loss (TOST, "
        "90% interval -0.010 .. -0.004)."
    ) in text
    # the same mean difference with seeds that disagree: no tie, not separable
    text = _report(tmp_path, _holm_and_window_results(0.03), name="wide")
    assert "does as well" not in text
    assert (
        "is **not separable at this power** from the window control: lssar p=15 - window = 95% "
        "interval -0.035 ± 0.075, neither better nor equivalent within ±0.02 loss (TOST)."
    ) in text


def _alternative_results(yarn_16x: float, yarn_jitter: float = 0.0):
    soft = [1.9, 2.0, 2.2, 2.5, 2.9]
    rope = lambda kind, losses, jitter=0.0: [  # noqa: E731
        r | {"rope_scaling": f"{kind} auto", "tag": f"softmax_{kind}_auto"}
        for r in _arm("softmax", "softmax", losses, jitter=jitter)
    ]
    return [
        *_arm("softmax", "softmax", soft),
        *_arm("lssar p=15", "lssar p=15", [1.93, 1.95, 2.0, 2.1, 2.2]),
        *_arm("softmax + alibi", "softmax + alibi", [1.92, 1.93, 1.95, 2.0, 2.05]),
        *_arm("softmax + nope", "softmax + nope", [1.95, 2.4, 2.9, 3.3, 3.6]),
        *_arm("lssar p=15 + nope", "lssar p=15 + nope", [1.96, 2.0, 2.1, 2.2, 2.3]),
        *rope("linear", [1.9, 2.1, 2.3, 2.45, 2.6]),
        *rope("yarn", [1.9, 1.95, 2.0, 2.05, yarn_16x], jitter=yarn_jitter),
    ]


def test_report_names_the_best_method_at_16x_only_beyond_noise(tmp_path, clean_env):
    text = _report(tmp_path, _alternative_results(yarn_16x=2.1))
    section = text.split("## LSSAR against the practitioner's alternatives")[1].split("\n## ")[0]
    assert "| ALiBi (softmax, trained) | lssar p=15 - softmax + alibi |" in section
    # at 16x LSSAR (2.2) is higher than ALiBi (2.05), lower than NoPE (3.6), every seed alike
    row = next(ln for ln in section.splitlines() if ln.startswith("| ALiBi"))
    assert row.endswith("| +0.150 ± 0.000 higher |")
    row = next(ln for ln in section.splitlines() if ln.startswith("| NoPE (softmax"))
    assert row.endswith("| -1.400 ± 0.000 lower |")
    assert "| YaRN on softmax+RoPE | lssar p=15 - softmax -> yarn auto (eval only) |" in section
    assert "| position interpolation (PI) on softmax+RoPE |" in section
    assert (
        "**softmax + alibi**, 2.050 ± 0.025: **the best method at 16x**, beyond noise: its paired "
        "interval against every other method excludes 0 (runner-up: softmax -> yarn auto (eval "
        "only) - softmax + alibi = +0.050 ± 0.000)."
    ) in section
    # YaRN 0.05 above ALiBi on average, but its seeds disagree (gaps 0, 0.05, 0.10): not separable
    text = _report(tmp_path, _alternative_results(2.05, yarn_jitter=0.05), name="tie")
    assert "but it is **not separable** from softmax -> yarn auto (eval only) at this power" in text
    assert "the best method at 16x" not in text
    one = [r for r in _alternative_results(2.1) if r["config"]["seed"] == 0]
    text = _report(tmp_path, one, name="one", preset="quick")
    assert "With one seed there is no interval, so no method is best beyond noise." in text


def test_report_with_one_seed_gives_no_interval_and_flags_dirty_code(tmp_path, clean_env):
    results = [
        _fake("softmax", "softmax", [3.2, 4.2, 5.5, 6.3, 7.0], dirty=True),
        _fake("lssar p=15", "lssar p=15", [3.2, 3.2, 3.2, 3.3, 3.3]),
    ]
    text = _report(tmp_path, results, preset="quick")
    assert text.splitlines()[2].startswith("**Built from uncommitted code**: 1 of 2 results")
    assert "measured -3.700 -> **no interval**" in text and "With one seed there is no" in text
    assert "Multiple seeds" not in text and "-> **supported**" not in text
    # what one seed can and cannot show, and links to the 3-seed reports the verdicts rest on
    said = text.split("## What one seed can and cannot show")[1].split("\n## ")[0]
    assert "cannot show that one arm is better" in said and "another machine" in said
    target = re.search(r"\[`cpu-2026-12-03`\]\(([^)]+)\)", said)[1]
    assert (tmp_path / "r" / target).resolve() == ROOT / "reports/cpu-2026-12-03/REPORT.md"
    clean_env["git_dirty"] = True  # a clean run, reported from a dirty checkout
    text = _report(tmp_path, [results[1]], name="d", preset="quick")
    assert (
        "0 of 1 results were trained or evaluated in a dirty checkout, and this report was "
        "written from one."
    ) in text


def _diag(entropy: float, sink: float, t: int, train_len: int = 16) -> dict:
    """A diagnostics entry at length ``t`` whose rows beyond ``train_len`` have ``entropy`` /
    ``sink`` and whose earlier rows have uniform attention's values."""
    n = np.arange(1, t + 1)
    far = n > train_len
    return {
        "entropy": [float(np.mean(np.where(far, entropy, np.log(n))))] * 2,
        "sink": [float(np.mean(np.where(far, sink, 1 / n)))] * 2,
        "windows": 8,
        "uniform_entropy": float(np.mean(np.log(n))),
        "uniform_sink": float(np.mean(1 / n)),
        "entropy_beyond": [entropy] * 2 if far.any() else None,
        "sink_beyond": [sink] * 2 if far.any() else None,
        "uniform_entropy_beyond": float(np.mean(np.log(n[far]))) if far.any() else None,
        "uniform_sink_beyond": float(np.mean(1 / n[far])) if far.any() else None,
        "row_bins": [[0, t // 2], [t // 2, t]],
        "entropy_by_row": [1.0, entropy],
        "sink_by_row": [0.1, sink],
        "uniform_entropy_by_row": [1.0, 2.0],
        "uniform_sink_by_row": [0.1, 0.01],
    }


def test_diagnostics_are_read_beyond_the_training_length_for_normalised_arms(tmp_path, clean_env):
    """The table's 16x columns are the rows past L, not a row mean the early rows dominate, and
    sigmoid (rows that do not sum to 1) is left off, with a note."""
    results = []
    for label, ent, sink in (("softmax", 1.5, 0.3), ("lssar p=15", 0.5, 0.001), ("sigmoid", 9, 9)):
        for r in _arm(label, label, [2.0] * 5):
            r["diagnostics"] = {str(m * 16): _diag(ent, sink, m * 16) for m in (1, 2, 4, 8, 16)}
            results.append(r)
    text = _report(tmp_path, results)
    section = text.split("## Attention diagnostics")[1].split("\n## ")[0]
    assert "| entropy, rows beyond L at 16x [uniform] |" in section
    # 1x: every row uniform (ln 1..16 averaged: 1.92); 16x beyond L: 1.50 against ln 17..256
    assert "| softmax | 8 x 3 | 1.92 ± 0.00 [1.92] | 1.50 ± 0.00 [4.74] |" in section
    assert "| 0.3000 ± 0.0000 [0.0114] |" in section  # mass beyond L against mean 1/17..1/256
    assert "| lssar p=15 | 8 x 3 |" in section and "| sigmoid |" not in section
    assert "Left off: sigmoid (unnormalised" in section
    for png in ("entropy_sink_vs_length", "entropy_sink_by_row"):
        assert (tmp_path / "r" / f"{png}.png").stat().st_size > 0


def test_passkey_section_is_inconclusive_until_learned(tmp_path, clean_env):
    def with_passkey(r, acc1, acc_long, near=1.0):
        """1x: every probe within L; 2x: 20 probes, 10 within (``near``), 10 beyond."""
        acc = {"16": {"0.5": acc1}, "32": {"0.5": acc_long}}
        split = {
            "16": {"within": {"hits": round(20 * acc1), "n": 20}, "beyond": {"hits": 0, "n": 0}},
            "32": {
                "within": {"hits": round(10 * near), "n": 10},
                "beyond": {"hits": round(20 * acc_long - 10 * near), "n": 10},
            },
        }
        return r | {
            "passkey": {
                "steps": 600,
                "check_accuracy": acc1,
                "reached": acc1 >= 0.9,
                "accuracy": acc,
                "by_distance": split,
            }
        }

    soft = [with_passkey(r, 1.0, 0.5) for r in _arm("softmax", "softmax", [2] * 5)]
    window = [
        with_passkey(r, 1.0, 0.5 + 0.05 * (i == 1))
        for i, r in enumerate(_arm("softmax", "softmax", [2] * 5, window=16))
    ]
    good = [
        with_passkey(r, 1.0, 0.9 + 0.05 * (i == 1))
        for i, r in enumerate(_arm("lssar p=15", "lssar p=15", [2] * 5))
    ]
    bad = [with_passkey(r, 0.5, 0.4, near=0.5) for r in _arm("lssa", "lssa", [2] * 5)]
    settings = pk.PasskeySettings(steps=600, warmup_steps=60, digits=1)
    preset = presets.Preset("t", "tiny-cpu", ["softmax"], multiples=[1, 2], passkey=settings)
    results = soft + window + good + bad
    out = reproduce_report.write_report("cpu", preset, results, tmp_path / "p", 1.0)
    text = (out / "REPORT.md").read_text()
    assert "A 1-digit key (chance 11.1%: the first digit is 1-9)" in text
    assert "for the same 600 steps (60 of warmup" in text and "no early stop" in text
    assert "| lssar p=15 | 3/3 | 100.0 ± 0.0% | 91.7 ± 7.2% |" in text
    assert "| lssa | 0/3 | 50.0 ± 0.0% | 40.0 ± 0.0% |" in text
    # beyond L: softmax 0/10 on every seed, lssar p=15 8, 9, 8 of 10
    assert "| lssar p=15 | 100.0 ± 0.0% (n=10) | 83.3 ± 14.3% (n=10) |" in text
    assert "| softmax | 100.0 ± 0.0% (n=10) | 0.0 ± 0.0% (n=10) |" in text
    assert "- lssar p=15 vs softmax at 2x, key beyond L: **supported**" in text
    assert (
        "- lssa vs softmax at 2x, key beyond L: **inconclusive (not learned at the training "
        "length)**"
    ) in text
    # the window control (0, 1, 0 of 10 beyond) is an arm of the passkey table, and every arm is
    # also compared with it
    assert "| softmax, sliding window 16 | 100.0 ± 0.0% (n=10) | 3.3 ± 14.3% (n=10) |" in text
    assert "- lssar p=15 vs the window control at 2x, key beyond L: **supported**" in text
    assert (tmp_path / "p" / "passkey.png").stat().st_size > 0


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


def test_tiny_end_to_end_reproduce(runs, tmp_path, monkeypatch):
    """Train 6 arms x 2 seeds (softmax, lssa, lssar p=15, the alternatives ALiBi and LSSAR
    without positions, and the decomposition's QK-norm softmax with its scale fixed at the
    training length), evaluate with the window control, an eval-time p, YaRN at the
    length multiple and passkey, write the report; a second invocation reuses every run and
    evaluation."""
    tiny = presets.Preset(
        "tiny",
        "tiny-cpu",
        [
            "softmax",
            "window",
            "lssa",
            "lssar p=15",
            "softmax + alibi",
            "lssar p=15 + nope",
            "softmax -> yarn auto",
            "softmax-qknorm-const",
        ],
        seeds=[0, 1],
        multiples=[1, 2],
        eval_tokens=192,
        passkey=pk.PasskeySettings(steps=2, warmup_steps=1, trials=1, digits=1),
        passkey_arms=["softmax", "window"],
    )
    monkeypatch.setitem(presets.PRESETS, "tiny", tiny)
    lssa = dataclasses.replace(presets.ARMS["lssa"], evals=(presets.LSSAR15,))  # one eval-only p
    monkeypatch.setitem(presets.ARMS, "lssa", lssa)
    data_dir = load_run(runs["softmax"])[2]["data_dir"]
    shrink = [f"{k}={v}" for k, v in TINY.items() if k not in ("seq_len", "eval_tokens")]
    overrides = [*shrink, "seq_len=96", "eval_tokens=192", "max_steps=3", f"data_dir={data_dir}"]
    kw = dict(runs=tmp_path / "runs", out=tmp_path / "reports" / "tiny", progress=False)
    out = lm_study.run_study("tiny", overrides=overrides, **kw)
    text = (out / "REPORT.md").read_text()
    assert out == kw["out"] and text.splitlines()[2].startswith(("Built", "**Built"))
    for label in (
        "softmax",
        "softmax, sliding window 96",
        "lssa",
        "lssa -> lssar p=15 (eval only)",
        "lssar p=15",
        "softmax + alibi",
        "lssar p=15 + nope",
        "softmax -> yarn auto (eval only)",
        "softmax-qknorm-const n=96",  # n set to this run's training length, 96
    ):
        assert f"| {label} | 2 x 192 |" in text, label
    assert (
        "| + QK-norm, scale fixed at ln d ln L (two changes: norm and scale) | "
        "softmax-qknorm-const n=96 - softmax |"
    ) in text
    const = load_run(tmp_path / "runs" / "tiny-cpu-softmax-qknorm-const-s1")[0]
    assert const.attn_spec == AttentionSpec("softmax-qknorm-const", {"n": 96})
    assert "## Passkey retrieval" in text and "| softmax | " in text.split("## Passkey")[1]
    assert "(12 runs)" in text and "## Provenance" in text
    assert "| `tiny-cpu-softmax-s0/eval/tiny/softmax_window96` |" in text  # where it lives
    assert "| `tiny-cpu-softmax-s0/eval/tiny/softmax_yarn_auto` |" in text  # on softmax's run
    assert "| `tiny-cpu-softmax-alibi-s1/eval/tiny/softmax` |" in text
    alternatives = text.split("## LSSAR against the practitioner's alternatives")[1]
    assert "| ALiBi (softmax, trained) | lssar p=15 - softmax + alibi |" in alternatives
    assert "| YaRN on softmax+RoPE | lssar p=15 - softmax -> yarn auto (eval only) |" in text
    # the window control is in the set the best method is chosen from
    assert (
        "Lowest mean loss at 2x among lssar p=15, softmax, softmax, sliding window 96, "
        "softmax + alibi"
    ) in alternatives
    results = json.loads((out / "results.json").read_text())["results"]
    assert len(results) == 18 and all(r["eval_version"] for r in results)
    # every result has the copy probe at 2L; every one but the window control its own window
    by_label: dict[str, list] = {}
    for r in results:
        by_label.setdefault(label_of(r), []).append(r)
        assert list(r["copy"]["second"]) == ["192"] and r["copy"]["segment"] == 64
        assert r["copy"]["probes"] == evaluate.COPY_PROBES
        assert ("own_window" in r) == (r["window"] is None), label_of(r)
    for r in results:
        if r["window"] is None:
            assert list(r["own_window"]["loss"]) == ["192"] and r["own_window"]["window"] == 96
    # softmax's own window is the window control: the same windows and probes, the same numbers
    for soft, win in zip(by_label["softmax"], by_label["softmax, sliding window 96"]):
        assert soft["own_window"]["loss"]["192"] == win["loss"]["192"]
        assert soft["own_window"]["copy"]["second"] == win["copy"]["second"]
        assert soft["copy"]["first"] == win["copy"]["first"]  # the first copy: same keys
    context = text.split("## Does each arm use the context beyond L?")[1].split("\n## ")[0]
    assert "| lssar p=15 | lssar p=15 - lssar p=15, own window |" in context
    assert "### The copy probe" in context and "| softmax + alibi | " in context
    # by quarter of the 2x window: the first L positions (Q1, Q2) see at most L keys either way
    assert "### Where in the longest window (2x)" in context
    assert "| arm | a - b | Q1 | Q2 | Q3 | Q4 |" in context
    groups = {label: rs for label, rs in by_label.items() if label != "softmax, sliding window 96"}
    full_q, own_q = verdicts.by_quarter_of(groups), verdicts.by_quarter_of(groups, own=True)
    assert set(full_q) == set(own_q) == set(groups)
    for label in full_q:
        for q in (1, 2):
            assert full_q[label][q] == pytest.approx(own_q[label][q], abs=1e-4), label
        assert full_q[label][4] != own_q[label][4]
    assert "LSSAR uses context beyond L (full context beats its own L-key window at 2x)" in text
    assert "LSSAR copies from beyond L (copy probe, 2x L back" in text
    assert sum("passkey" in r for r in results) == 4  # softmax and its window control, 2 seeds
    assert "| softmax, sliding window 96 | " in text.split("### By distance from the question")[1]
    # YaRN at factor auto is the softmax model itself at 1x
    by = {(Path(r["run"]).name, r["tag"]): r for r in results}
    yarn, soft = (
        by[("tiny-cpu-softmax-s0", "softmax_yarn_auto")],
        by[("tiny-cpu-softmax-s0", "softmax")],
    )
    assert yarn["loss"]["96"] == soft["loss"]["96"] and yarn["loss"]["192"] != soft["loss"]["192"]
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("results.json")}
    assert len(stamps) == 18  # each preset keeps its evaluations apart: RUN/eval/<preset>/<tag>
    assert all(p.parent.parent.name == "tiny" for p in stamps)
    again = lm_study.run_study("tiny", overrides=overrides, **kw)
    assert (again / "REPORT.md").exists()
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("results.json")}


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
    scale rule (sdpa / ln N_i / frozen, with or without a learned s_h), QK-norm, re-weighting."""
    va, vb = (VARIANTS[presets.ARMS[x].attention.name] for x in (a, b))
    pa, pb = (presets.ARMS[x].attention.options.get("p") for x in (a, b))
    things = [
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


def test_reproduce_rejects_unknown_preset_and_prints_the_paper_plan(capsys):
    assert cli_main(["reproduce", "--preset", "huge"]) == 2
    assert (
        "choose from quick, cpu, cpu-baselines, cpu-decomposition, cpu-paper-regime, paper"
        in capsys.readouterr().err
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
    from lssar import runio

    monkeypatch.setattr(runio, "_git", lambda *a: status)
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
    assert "1 of 3 results do not record their command" in adhoc
