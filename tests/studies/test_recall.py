"""The associative-recall study: generator invariants, bad input, end-to-end, resume."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lssar.studies.recall.task import BOS, IGNORE, QUERY, RecallTask

TASK = RecallTask(train_len=64, n_pairs=6, n_queries=4, n_keys=16, n_values=16, n_filler=8)


@pytest.mark.parametrize("order", ["kv", "vk"])
@pytest.mark.parametrize("length", [64, 128, 256, 1024])
def test_generator_invariants(length, order):
    import dataclasses

    task = dataclasses.replace(TASK, pair_order=order)
    step = 1 if order == "kv" else -1  # where a key's value sits
    b = task.batch(seed=(3, length), length=length, size=20)
    tok, tgt = b["tokens"].numpy(), b["targets"].numpy()
    assert tok.shape == (20, length) and tgt.shape == (20, length)  # lengths exact
    assert tok.min() >= 0 and tok.max() < TASK.vocab_size
    is_key = (tok >= TASK.key0) & (tok < TASK.value0)
    for s in range(20):
        t = tok[s]
        assert t[0] == BOS
        m = TASK.n_queries
        ctx = t[: length - 3 * m]
        keys = ctx[is_key[s, : length - 3 * m]]
        assert len(keys) == TASK.n_pairs and len(set(keys.tolist())) == TASK.n_pairs  # no reuse
        pairs = {int(ctx[i]): int(ctx[i + step]) for i in np.flatnonzero(is_key[s, : len(ctx)])}
        assert len(set(pairs.values())) == TASK.n_pairs  # pairs distinct
        assert all(TASK.value0 <= v < TASK.filler0 for v in pairs.values())
        block = t[length - 3 * m :].reshape(m, 3)
        assert (block[:, 0] == QUERY).all()
        assert len(set(block[:, 1].tolist())) == m
        qp, kp = b["query_pos"][s].numpy(), b["key_pos"][s].numpy()
        for j in range(m):
            k = t[qp[j]]
            assert t[kp[j]] == k and pairs[int(k)] == b["answer"][s, j]  # answers correct
            assert tgt[s, qp[j]] == pairs[int(k)] == t[qp[j] + 1]
            assert b["distance"][s, j] == qp[j] - kp[j] > 0
        assert (tgt[s] != IGNORE).sum() == m
    d = b["distance"].numpy()
    if length == TASK.train_len:
        assert (d < TASK.train_len).all()
    else:  # stratified: the first ceil(m/2) queries within train_len, the rest beyond
        assert (d[:, :2] < TASK.train_len).all() and (d[:, 2:] >= TASK.train_len).all()


def test_generator_deterministic_from_seed():
    a, b = TASK.batch(7, 128, 8), TASK.batch(7, 128, 8)
    c = TASK.batch(8, 128, 8)
    for k in a:
        assert torch.equal(a[k], b[k])
    assert not torch.equal(a["tokens"], c["tokens"])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(train_len=0), "train_len"),
        (dict(train_len=-5), "train_len"),
        (dict(n_pairs=40, n_keys=32), "n_pairs"),
        (dict(n_queries=9, n_pairs=8), "n_queries"),
        (dict(train_len=20, n_pairs=8, n_queries=4), "train_len"),
        (dict(pair_order="kk"), "pair_order"),
    ],
)
def test_bad_task(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RecallTask(**kwargs)


def test_bad_length():
    with pytest.raises(ValueError, match="length"):
        TASK.batch(0, 0, 2)
    with pytest.raises(ValueError, match="too short"):
        TASK.batch(0, TASK.min_length() - 1, 2)


# ----------------------------------------------------------------------------- the study

from lssar.studies.recall.presets import ARMS, StudyConfig, preset_config  # noqa: E402
from lssar.studies.recall.study import run_dir, run_study, train_arm, units  # noqa: E402
from lssar.train.checkpoint import save_checkpoint  # noqa: E402

TINY_TASK = RecallTask(train_len=24, n_pairs=2, n_queries=2, n_keys=8, n_values=8, n_filler=4)


def tiny(**kw) -> StudyConfig:
    base = dict(
        task=TINY_TASK, arms=("softmax", "lssa"), seeds=(0,), multiples=(1, 2), n_layer=1,
        n_head=2, n_embd=16, steps=6, batch_size=4, warmup=2, eval_seqs=6, eval_batch=3,
        eval_ps=(15.0,), ckpt_every=2,
    )  # fmt: skip
    return StudyConfig(**(base | kw))


def test_bad_study_input():
    with pytest.raises(ValueError, match="arm"):
        tiny(arms=("softmax", "nope"))
    with pytest.raises(ValueError, match="preset"):
        preset_config("huge")
    with pytest.raises(ValueError, match="multiples"):
        tiny(multiples=(1, 0))
    with pytest.raises(ValueError, match="steps"):
        tiny(steps=0)
    with pytest.raises(ValueError, match="jobs"):
        tiny(jobs=0)
    from lssar.cli import main

    assert main(["recall", "--preset", "nope"]) == 2


def test_presets_wired():
    from lssar.studies.recall.presets import ALTERNATIVE_ARMS, PAPER_ARMS

    assert set(PAPER_ARMS) | set(ALTERNATIVE_ARMS) == set(ARMS)
    assert preset_config("cpu").arms == PAPER_ARMS and len(preset_config("cpu").seeds) >= 3
    base = preset_config("cpu-baselines")
    assert set(base.arms) == {"softmax", "lssar p=15", *ALTERNATIVE_ARMS}
    assert base.seeds == preset_config("cpu").seeds and base.task == preset_config("cpu").task
    q = preset_config("quick")
    assert {"softmax", "lssa", "window"} <= set(q.arms) and len(q.seeds) == 1
    for name in ("quick", "cpu", "cpu-baselines"):  # >= 200 scored queries per cell
        c = preset_config(name)
        assert c.eval_seqs * (c.task.n_queries // 2) >= 200
    assert preset_config("cpu").task == q.task  # quick is a subset of cpu, same runs


def test_end_to_end_rows_and_report(tmp_path):
    cfg = tiny()
    out = run_study(cfg, tmp_path / "rep", tmp_path / "runs", progress=False, name="test")
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    keys = {"arm", "train_attn", "train_pos", "eval_attn", "eval_p", "eval_rope", "seed",
            "length_multiple", "distance", "accuracy", "queries"}  # fmt: skip
    assert rows and all(set(r) == keys for r in rows)
    arms = {r["arm"] for r in rows}
    assert arms == {"softmax", "lssa", "lssa -> lssar p=15 (eval)"}
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["queries"] > 0
    by = {(r["arm"], r["length_multiple"], r["distance"]): r for r in rows}
    assert by[("softmax", 1, "all")]["queries"] == 6 * 2  # eval_seqs * n_queries
    assert ("softmax", 1, "beyond") not in by  # nothing is beyond L at 1x
    assert by[("softmax", 2, "within")]["queries"] == by[("softmax", 2, "beyond")]["queries"] == 6
    assert by[("lssa -> lssar p=15 (eval)", 2, "all")]["eval_attn"] == "lssar"
    rep = (out / "REPORT.md").read_text()
    assert "## Accuracy by length" in rep and "One seed: no confidence intervals" in rep
    assert "Training runs: commit " in rep  # provenance: the commits the numbers come from
    assert "**supported: " not in rep  # one seed: nothing supported
    # the rule the verdicts use (stats.verdict: paired by seed), not interval overlap
    assert "t-interval of the per-seed differences (paired by seed) excludes 0" in rep
    for png in ("accuracy_vs_length.png", "distance_split.png", "attention_maps.png"):
        assert (out / png).stat().st_size > 1000
    # a second invocation reuses the finished runs (no retraining)
    rd = run_dir(tmp_path / "runs", cfg, ARMS["softmax"], 0)
    before = (rd / "ckpt/final.pt").stat().st_mtime_ns
    run_study(cfg, tmp_path / "rep2", tmp_path / "runs", progress=False, attention_maps=False)
    assert (rd / "ckpt/final.pt").stat().st_mtime_ns == before
    rows2 = json.loads((tmp_path / "rep2" / "results.json").read_text())["rows"]
    assert rows2 == rows


def test_pilot_reports_training_accuracy_and_when_it_learned(tmp_path, capsys):
    """``lssar recall --pilot``: training only; one row per model with the step it learned."""
    from lssar.cli import main
    from lssar.studies.recall.report import write_pilot

    argv = ["recall", "--pilot", "--arms", "softmax,window", "--seeds", "0", "--no-progress"]
    argv += ["--out", str(tmp_path / "pilot"), "--runs", str(tmp_path / "runs")]
    argv += ["--set", "steps=50", "--set", "n_layer=1", "--set", "n_embd=16", "--set", "jobs=1"]
    argv += ["--set", "task.n_pairs=2", "--set", "task.n_queries=2", "--set", "token_shift=false"]
    assert main(argv) == 0
    text = (tmp_path / "pilot" / "PILOT.md").read_text()
    assert text.startswith("# lssar recall --pilot (preset quick)")
    assert "2 pairs, 2 queries" in text and "token shift off" in text and "50 steps" in text
    assert "| softmax = window | 0 | " in text  # the window trains as softmax: one model
    assert not (tmp_path / "pilot" / "REPORT.md").exists()  # nothing evaluated
    data = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    assert [m["arms"] for m in data["models"]] == [["softmax", "window"]]
    assert data["meta"]["command"] == "lssar " + " ".join(argv)
    # the verdict column: the first logged step at 99%, or "no" within the budget
    model = dict(data["models"][0], log=[{"step": 50, "acc": 0.5}, {"step": 100, "acc": 0.995}])
    write_pilot([model], data["meta"], tmp_path / "w")
    assert "| step 100 | 50.0% | 99.5% |" in (tmp_path / "w" / "PILOT.md").read_text()
    model["log"] = [{"step": 50, "acc": 0.5}]
    write_pilot([model], data["meta"], tmp_path / "w")
    assert "| no (in 50 steps) | 50.0% |" in (tmp_path / "w" / "PILOT.md").read_text()
    capsys.readouterr()
    assert main(["recall", "--pilot", "--set", "colour=red"]) == 2
    assert "--set colour: unknown setting" in capsys.readouterr().err


def test_resume_matches_uninterrupted(tmp_path):
    cfg = tiny(arms=("window",))
    arm = ARMS["window"]
    full, _ = train_arm(cfg, arm, 0, tmp_path / "a", progress=False)
    _, info = train_arm(cfg, arm, 0, tmp_path / "b", progress=False, stop_after=3)
    rd = run_dir(tmp_path / "b", cfg, arm, 0)
    assert info == {"finished": False, "step": 3}
    assert (rd / "ckpt/latest.pt").exists() and not (rd / "DONE").exists()
    resumed, done = train_arm(cfg, arm, 0, tmp_path / "b", progress=False)
    assert done["finished"] and done["steps"] == 6 and (rd / "ckpt/final.pt").exists()
    # the log continues where the checkpoint was: every 50 steps and the last, no duplicates
    assert [r["step"] for r in done["log"]] == [6]
    assert json.loads((rd / "env.json").read_text())["start_step"] == 3
    for (n, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n


def test_window_arm_shares_softmax_run_and_hides_far_keys():
    from lssar.studies.recall.study import build_model

    cfg = tiny()
    assert run_dir(Path("r"), cfg, ARMS["window"], 0) == run_dir(Path("r"), cfg, ARMS["softmax"], 0)
    torch.manual_seed(0)
    model = build_model(cfg, ARMS["softmax"]).eval()
    T, W = 40, 8
    x = torch.randint(0, cfg.task.vocab_size, (1, T))
    y = x.clone()
    y[0, 1 : T - 2 * W] = (y[0, 1 : T - 2 * W] + 1) % cfg.task.vocab_size  # far, not BOS
    with torch.no_grad():
        a, _ = model(x, window=W)
        b, _ = model(y, window=W)
        c, _ = model(y)
    # one layer: the last position sees only the last W tokens under the window
    assert torch.allclose(a[0, -1], b[0, -1], atol=1e-6)
    assert not torch.allclose(a[0, -1], c[0, -1], atol=1e-6)
    z = y.clone()
    z[0, 0] = (z[0, 0] + 1) % cfg.task.vocab_size  # the sink (first token) stays visible
    with torch.no_grad():
        d, _ = model(z, window=W)
    assert not torch.allclose(b[0, -1], d[0, -1], atol=1e-6)
    # the window path (O(T W)) is the dense mask it replaced: the last W keys and BOS
    i = torch.arange(T)
    dense = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < W) | (i[None, :] == 0))
    with torch.no_grad():
        torch.testing.assert_close(model(y, window=W)[0], model(y, attn_mask=dense)[0])


def test_token_shift_is_causal_and_one_token_back():
    from lssar.studies.recall.model import RecallModel

    cfg = tiny(n_layer=1)
    from lssar.studies.recall.study import build_model

    torch.manual_seed(0)
    model = build_model(cfg, ARMS["softmax"]).eval()
    assert isinstance(model, RecallModel) and model.prev is not None
    T = 12
    x = torch.randint(0, cfg.task.vocab_size, (2, T))
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % cfg.task.vocab_size
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(y)
    assert torch.equal(a[:, :7], b[:, :7])  # causal: the past is unchanged
    assert not torch.allclose(a[:, 8], b[:, 8])  # the next position sees the changed token
    # without attention's help (mask: each position sees only itself and BOS), position 8
    # still depends on token 7 through the shift, and on nothing further back
    eye = torch.eye(T, dtype=torch.bool)
    eye[:, 0] = True
    z = x.clone()
    z[:, 3] = (z[:, 3] + 1) % cfg.task.vocab_size
    with torch.no_grad():
        c, _ = model(y, attn_mask=eye)
        d, _ = model(x, attn_mask=eye)
        e, _ = model(z, attn_mask=eye)
    assert not torch.allclose(c[:, 8], d[:, 8])
    assert torch.equal(d[:, 8], e[:, 8])
    plain = build_model(tiny(token_shift=False), ARMS["softmax"])
    assert plain.prev is None


def test_parallel_jobs_give_the_same_rows(tmp_path):
    cfg = tiny(arms=("softmax", "window", "lssa"))
    assert [a for _, a in units(cfg)] == [
        ("softmax", "window"),
        ("lssa",),
    ]  # the window arm shares softmax's model: one unit
    one = run_study(cfg, tmp_path / "r1", tmp_path / "runs1", progress=False, attention_maps=False)
    two = run_study(
        tiny(arms=("softmax", "window", "lssa"), jobs=2),
        tmp_path / "r2",
        tmp_path / "runs2",
        progress=False,
        attention_maps=False,
    )
    rows1 = json.loads((one / "results.json").read_text())["rows"]
    rows2 = json.loads((two / "results.json").read_text())["rows"]
    key = ("arm", "seed", "length_multiple", "distance", "queries")
    assert [tuple(r[k] for k in key) for r in rows1] == [tuple(r[k] for k in key) for r in rows2]
    acc1 = np.array([r["accuracy"] for r in rows1])
    acc2 = np.array([r["accuracy"] for r in rows2])
    assert np.abs(acc1 - acc2).max() <= 1 / 6  # one flipped near-tie at most (threads differ)


# ------------------------------------------------------------- files read back


class _Planted:
    """A pickle that, loaded with weights_only=False, creates a file: code run from a run dir."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_checkpoint_is_read_as_data_and_never_run(tmp_path):
    cfg = tiny(arms=("lssa",))
    rd = run_dir(tmp_path / "runs", cfg, ARMS["lssa"], 0)
    rd.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    (rd / "ckpt").mkdir()
    torch.save({"model": _Planted(marker)}, rd / "ckpt/latest.pt")
    with pytest.raises(ValueError, match=r"latest\.pt is corrupt \(it holds Python objects"):
        train_arm(cfg, ARMS["lssa"], 0, tmp_path / "runs", progress=False)
    assert not marker.exists()
    (rd / "ckpt/latest.pt").unlink()
    train_arm(cfg, ARMS["lssa"], 0, tmp_path / "runs", progress=False, stop_after=2)
    half = rd / "ckpt" / ".latest.pt.4242.tmp"  # a checkpoint write that was killed: removed
    half.write_bytes(b"partial")
    _, done = train_arm(cfg, ARMS["lssa"], 0, tmp_path / "runs", progress=False)
    assert done["finished"] and not half.exists()


def test_recall_eval_cache_is_keyed_by_model_and_sequences(tmp_path):
    from lssar.studies.recall.study import evaluate_arm

    cfg, arm = tiny(arms=("lssa",)), ARMS["lssa"]
    model, _ = train_arm(cfg, arm, 0, tmp_path / "runs", progress=False)
    rd = run_dir(tmp_path / "runs", cfg, arm, 0)
    first = evaluate_arm(model, cfg, arm, None, rd)
    assert evaluate_arm(model, cfg, arm, None, rd) == first  # reused
    # eval_batch cuts the evaluation into seeded chunks: other sequences, same cache file name
    other = tiny(arms=("lssa",), eval_batch=2)
    again = evaluate_arm(model, other, arm, None, rd)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "ckpt").mkdir()
    (fresh / "ckpt/final.pt").write_bytes((rd / "ckpt/final.pt").read_bytes())
    assert again == evaluate_arm(model, other, arm, None, fresh) != first
    # a retrained model (other weights in ckpt/final.pt) is scored again
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)
    save_checkpoint(rd / "ckpt/final.pt", model=model.state_dict())
    evaluate_arm(model, other, arm, None, rd)
    stored = json.loads((rd / "eval-trained-6.json").read_text())
    assert (
        stored["key"]["model_sha256"]
        == hashlib.sha256((rd / "ckpt/final.pt").read_bytes()).hexdigest()
    )


def test_end_to_end_with_the_practitioners_alternatives(tmp_path):
    """ALiBi and LSSAR without positions trained, YaRN and NTK at the length multiple on the
    softmax model: their rows (labelled, keyed) and question 5 of the report; the RoPE scalings
    share softmax's model (one unit) and are the softmax model itself at 1x."""
    arms = ("softmax", "lssar p=15", "softmax + alibi", "lssar p=15 + nope",
            "softmax -> yarn auto", "softmax -> ntk auto")  # fmt: skip
    cfg = tiny(arms=arms, eval_ps=None)
    assert [a for _, a in units(cfg)] == [
        ("softmax", "softmax -> yarn auto", "softmax -> ntk auto"),
        ("lssar p=15",),
        ("softmax + alibi",),
        ("lssar p=15 + nope",),
    ]
    assert run_dir(Path("r"), cfg, ARMS["softmax + alibi"], 0).name.startswith("softmax-alibi-s0-")
    out = run_study(cfg, tmp_path / "rep", tmp_path / "runs", progress=False, name="test")
    rows = json.loads((out / "results.json").read_text())["rows"]
    by = {(r["arm"], r["length_multiple"], r["distance"]): r for r in rows}
    assert {r["arm"] for r in rows} == {
        "softmax", "lssar p=15", "softmax + alibi", "lssar p=15 + nope",
        "softmax -> yarn auto (eval)", "softmax -> ntk auto (eval)",
    }  # fmt: skip
    yarn = by[("softmax -> yarn auto (eval)", 2, "all")]
    assert (yarn["train_pos"], yarn["eval_attn"], yarn["eval_rope"]) == (
        "rope",
        "softmax",
        "yarn auto",
    )
    assert by[("softmax + alibi", 1, "all")]["train_pos"] == "alibi"
    assert (
        by[("softmax -> yarn auto (eval)", 1, "all")]["accuracy"]
        == by[("softmax", 1, "all")]["accuracy"]
    )
    rep = (out / "REPORT.md").read_text()
    assert "### 5. LSSAR against the practitioner's alternatives" in rep
    assert "| lssar p=15 vs softmax + alibi | beyond |" in rep
    assert "| lssar p=15 vs softmax -> yarn auto (eval) | beyond |" in rep
    assert "Highest mean accuracy at 2x (beyond) among lssar p=15, softmax" in rep
