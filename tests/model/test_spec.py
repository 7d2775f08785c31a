"""AttentionSpec: labels, the eval-time switching rule, config forms, and old run dirs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lssar import data
from lssar.cli import main as cli_main
from lssar.integrations.lm_eval import LssarLM
from lssar.model import GPT, GPTConfig
from lssar.positions import RopeScaling
from lssar.spec import AttentionSpec
from lssar.studies.labels import run_label
from lssar.studies.lm import evaluate, presets
from lssar.studies.lm import report as reproduce_report
from lssar.studies.lm.presets import SOFTMAX
from lssar.train import sample_cli
from lssar.train.checkpoint import save_checkpoint
from lssar.train.config import TrainConfig, model_config
from lssar.train.runs import load_run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_labels_are_the_strings_reports_look_up():
    lssar15, lssa = AttentionSpec("lssar", {"p": 15.0}), AttentionSpec("lssa")
    assert (lssar15.label, lssa.label, AttentionSpec("lssar", {"p": 3}).label) == (
        "lssar p=15",
        "lssa",
        "lssar p=3",
    )
    assert AttentionSpec("sigmoid-l1", {"p": 2.5, "bias": -1.0}).label == "sigmoid-l1 bias=-1 p=2.5"
    assert AttentionSpec("lssar", {"p": 15.0}, "chunked").label == "lssar p=15"  # impl: no math
    assert (lssar15.slug(), lssar15.slug("_"), lssa.slug()) == ("lssar-p15", "lssar_p15", "lssa")
    assert run_label(lssa, lssar15) == "lssa -> lssar p=15 (eval only)"
    assert run_label("lssa", "lssar p=15") == run_label(lssa, lssar15)
    assert run_label(lssa, lssa) == run_label("lssa") == "lssa"
    # a RoPE scaling at evaluation, alone and with a switched rule
    assert run_label("softmax", "softmax", "yarn auto") == "softmax -> yarn auto (eval only)"
    assert run_label(lssa, lssar15, "yarn x4") == "lssa -> lssar p=15 + yarn x4 (eval only)"
    # the claims of reproduce's report are found by these labels
    assert {"softmax", "lssa", "lssar p=3", "lssar p=15"} <= set(reproduce_report.PAPER)
    quick = presets.PRESETS["quick"].arms
    assert quick == ["softmax", "window", "lssa", "lssar p=15"]
    assert [presets.ARMS[a].attention.label for a in quick] == ["softmax", "softmax", *quick[2:]]


def test_eval_rules_carry_an_attention_switch_and_or_a_rope_scaling():
    from lssar.studies.common import Arm, EvalRule

    p15, yarn = AttentionSpec("lssar", {"p": 15.0}), RopeScaling("yarn")
    assert EvalRule(p15).label == "lssar p=15" and EvalRule(p15).slug() == "lssar-p15"
    assert EvalRule(rope=yarn).label == "yarn auto" and EvalRule(rope=yarn).slug() == "yarn-auto"
    assert EvalRule(p15, yarn).label == "lssar p=15 + yarn auto"
    with pytest.raises(ValueError, match="needs an attention switch, a RoPE scaling, or both"):
        EvalRule()
    # an AttentionSpec in evals is the rule that switches to it: the existing arms are unchanged
    lssa = presets.ARMS["lssa"]
    assert lssa.evals == tuple(EvalRule(s) for s in presets.EVAL_REWEIGHT)
    assert [e.label for e in lssa.evals] == [f"lssar p={p:g}" for p in (1, 3, 8, 15)]
    assert presets.PRESETS["cpu"].arms == presets.PAPER_ARMS == [
        "softmax", "window", "sigmoid", "relu", "softplus-l1", "lssa", "lssar p=3",
        "lssar p=15", "softmax-qknorm-logn", "ssmax",
    ]  # fmt: skip
    alibi = presets.ARMS["softmax + alibi"]
    assert (alibi.trained_label, alibi.pos, alibi.attention) == (
        "softmax + alibi",
        "alibi",
        SOFTMAX,
    )
    assert presets.ALTERNATIVES[-1] == "softmax -> yarn auto (eval only)"
    with pytest.raises(ValueError, match="pos='alibi' biases the scores"):
        Arm("x", AttentionSpec("lssa"), pos="alibi")
    with pytest.raises(ValueError, match="no rule of its own and no eval-only rules"):
        Arm("x", SOFTMAX, own_rule=False)


def test_spec_is_a_validated_frozen_value():
    a = AttentionSpec("lssar", {"p": 15.0})
    assert a == AttentionSpec("lssar", {"p": 15}) and hash(a) == hash(
        AttentionSpec("lssar", {"p": 15})
    )
    assert a != AttentionSpec("lssar", {"p": 15.0}, "reference")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "lssa"  # type: ignore[misc]
    opts = {"p": 3.0}
    b = AttentionSpec("lssar", opts)
    opts["p"] = 5.0
    assert b.options == {"p": 3.0}  # its own copy
    for bad, match in (
        (("nope",), "unknown attention variant"),
        (("relu", {"p": 2.0}), "takes no option 'p'"),
        (("lssar", {}, "warp"), "unknown attn_impl"),
        (("ssmax", {"s": 1.0}), "learned parameter"),
    ):
        with pytest.raises(ValueError, match=match):
            AttentionSpec(*bad)


def test_override_rule():
    trained = AttentionSpec("lssa", {}, "chunked")
    # options on top of the trained ones; the impl kept where it runs the new rule
    assert trained.override(p=15.0) == AttentionSpec("lssa", {"p": 15.0}, "chunked")
    assert trained.override("lssar", p=3.0) == AttentionSpec("lssar", {"p": 3.0}, "chunked")
    # an impl that does not run the new variant gives way to auto
    sdpa = AttentionSpec("softmax", {}, "sdpa")
    assert sdpa.override("lssar") == AttentionSpec("lssar", {}, "auto")
    assert sdpa.override(p=2.0) == AttentionSpec("softmax", {"p": 2.0}, "auto")  # sdpa: no p
    assert sdpa.override("softmax-qknorm-logn").impl == "sdpa"
    # naming a variant starts from its defaults; None means "not given"
    sig = AttentionSpec("sigmoid-l1", {"p": 2.0, "bias": -1.0})
    assert sig.override(p=3.0).options == {"p": 3.0, "bias": -1.0}
    assert sig.override("sigmoid-l1").options == {}
    assert sig.override(None, p=None) == sig
    assert trained.override("lssar", impl="reference").impl == "reference"
    with pytest.raises(ValueError, match="takes no option 'p'"):
        trained.override("relu", p=2.0)


def test_config_forms_round_trip():
    spec = AttentionSpec("lssar", {"p": 3.0}, "chunked")
    assert spec.to_config() == {"attn": "lssar", "attn_options": {"p": 3.0}, "attn_impl": "chunked"}
    assert spec.to_train() == {"attn": "lssar", "attn_p": 3.0, "attn_impl": "chunked"}
    assert AttentionSpec.from_config(spec.to_config()) == spec
    assert AttentionSpec.from_config(spec.to_train()) == spec
    cfg = TrainConfig(**spec.to_train())
    assert cfg.attention == spec == model_config(cfg, 256).attention
    assert AttentionSpec.from_config(model_config(cfg, 256)) == spec
    assert AttentionSpec.from_config({"attn": "lssa"}) == AttentionSpec("lssa")  # keys missing
    with pytest.raises(ValueError, match="no field for the option"):
        AttentionSpec("sigmoid-l1", {"bias": 0.5}).to_train()
    # the constant-scale arms carry their length n through TrainConfig.attn_n (and back)
    const = AttentionSpec("softmax-qknorm-const", {"n": 128})
    assert const.to_train() == {
        "attn": "softmax-qknorm-const",
        "attn_p": None,
        "attn_impl": "auto",
        "attn_n": 128,
    }
    cfg = TrainConfig(**const.to_train())
    assert cfg.attention == const == model_config(cfg, 256).attention
    assert (const.label, const.slug()) == (
        "softmax-qknorm-const n=128",
        "softmax-qknorm-const-n128",
    )
    assert TrainConfig(attn="lssa-const").attention.label == "lssa-const"  # the default n: 1024


def test_model_runs_its_spec_and_set_attention_takes_both_forms():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, attn="lssa")).eval()
    assert model.attn_spec == AttentionSpec("lssa")
    x = torch.randint(0, 256, (2, 9))
    model.set_attention("lssar", {"p": 3.0})
    by_name = model(x)[0]
    model.set_attention(AttentionSpec("lssar", {"p": 3.0}))
    assert torch.equal(model(x)[0], by_name)
    with pytest.raises(ValueError, match="inside the AttentionSpec"):
        model.set_attention(AttentionSpec("lssar"), {"p": 3.0})


# ----------------------------------------------------------------------- an old run dir


def _old_run(root: Path, attn: str, attn_p: float | None, impl: str) -> Path:
    """A run directory written by hand as the first versions wrote it (fewer config keys)."""
    data_dir = data.prepare("shakespeare", "byte", root / "data", max_tokens=20_000, progress=False)
    gpt_config = {
        "vocab_size": 256,
        "n_layer": 1,
        "n_head": 2,
        "n_kv_head": None,
        "n_embd": 16,
        "mlp_ratio": 4.0,
        "dropout": 0.0,
        "rope_base": 10000.0,
        "attn": attn,
        "attn_options": {} if attn_p is None else {"p": attn_p},
        "attn_impl": impl,
    }
    config = {  # a TrainConfig of an older version: no dtype, max_time_s; an extra key
        "corpus": "shakespeare",
        "tokenizer": "byte",
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 16,
        "attn": attn,
        "attn_p": attn_p,
        "attn_impl": impl,
        "seq_len": 16,
        "max_steps": 1,
        "retired_key": 1,
    }
    torch.manual_seed(0)
    model = GPT(GPTConfig(**gpt_config))
    run = root / "runs" / f"old-{attn}"
    save_checkpoint(
        run / "ckpt" / "final.pt",
        model=model.state_dict(),
        step=1,
        tokens=64,
        val_history=[[1, 5.0]],
        config=config,
        gpt_config=gpt_config,
        data_dir=str(data_dir),
        tokenizer="byte",
        corpus="shakespeare",
    )
    return run


@pytest.fixture(scope="module")
def old_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("old")
    return {
        "lssa": _old_run(root, "lssa", None, "chunked"),
        "softmax": _old_run(root, "softmax", None, "sdpa"),
    }


def test_old_run_dir_loads(old_runs):
    model, cfg, meta = load_run(old_runs["lssa"])
    assert model.attn_spec == cfg.attention == AttentionSpec("lssa", {}, "chunked")
    assert cfg.seq_len == 16 and meta["step"] == 1


YARN4 = RopeScaling("yarn", 4.0)


@pytest.mark.parametrize(
    "run, switch, want, rope",
    [
        ("lssa", dict(attn_p=15.0), AttentionSpec("lssa", {"p": 15.0}, "chunked"), None),
        (
            "lssa",
            dict(attn="lssar", attn_p=3.0),
            AttentionSpec("lssar", {"p": 3.0}, "chunked"),
            None,
        ),
        ("softmax", dict(attn="lssar"), AttentionSpec("lssar", {}, "auto"), None),
        (
            "softmax",
            dict(rope_scaling="yarn", rope_factor=4.0),
            AttentionSpec("softmax", {}, "sdpa"),
            YARN4,
        ),
        (
            "lssa",
            dict(attn="lssar", rope_scaling="ntk"),
            AttentionSpec("lssar", {}, "chunked"),
            RopeScaling("ntk"),
        ),
    ],
)
def test_eval_sample_and_lm_eval_switch_by_the_same_rule(
    old_runs, monkeypatch, capsys, run, switch, want, rope
):
    """``lssar eval``, ``lssar sample`` and ``lssar lm-eval`` end on the same spec and RoPE
    scaling (from the run's training length)."""
    seen = []
    original = GPT.set_attention

    def spy(self, *args, **kw):
        original(self, *args, **kw)
        seen.append((self.attn_spec, self.rope_scaling, self.rope_train_len))

    monkeypatch.setattr(GPT, "set_attention", spy)
    original_rope = GPT.set_rope_scaling

    def spy_rope(self, *args, **kw):
        original_rope(self, *args, **kw)
        seen[-1] = (self.attn_spec, self.rope_scaling, self.rope_train_len)

    monkeypatch.setattr(GPT, "set_rope_scaling", spy_rope)
    want = (want, rope, None if rope is None else 16)
    r = evaluate.evaluate_run(
        old_runs[run],
        [1],
        eval_tokens=32,
        diagnostics=False,
        health=False,
        progress=False,
        **switch,
    )
    tag = want[0].slug("_") + ("" if rope is None else "_" + rope.slug())
    assert seen[-1] == want and r["evaluated_attention"] == want[0].label
    assert r["rope_scaling"] == (None if rope is None else rope.label)
    assert r["trained_attention"] == run and (old_runs[run] / "eval" / tag).is_dir()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in switch.items()]
    assert sample_cli([str(old_runs[run]), "--max-new-tokens=2", *flags]) == 0
    assert seen[-1] == want
    capsys.readouterr()
    argv = ["eval", str(old_runs[run]), "--lengths=1", "--tokens=32", "--no-diagnostics", *flags]
    assert cli_main(argv) == 0
    assert seen[-1] == want and f"eval/{tag}" in capsys.readouterr().out
    LssarLM(run=str(old_runs[run]), **switch)
    assert seen[-1] == want
