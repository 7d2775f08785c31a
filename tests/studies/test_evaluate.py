"""Evaluation of trained runs (loss vs length, the window control, eval-time overrides, passkey)
and the tiny end-to-end `reproduce` built on them; the report is in test_lm_report.py, the rest of
the command in test_reproduce.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from lssar import data
from lssar.cli import main as cli_main
from lssar.data import passkey
from lssar.spec import AttentionSpec
from lssar.studies.labels import label_of
from lssar.studies.lm import evaluate, presets, verdicts
from lssar.studies.lm import passkey as pk
from lssar.studies.lm import study as lm_study
from lssar.train import train
from lssar.train.config import load_config
from lssar.train.runs import load_run

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
