"""The training config (lssar.train.config): precedence of preset, file and overrides, types,
errors, the override parser, the LR schedule, the dtype auto choice, an old run's config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lssar.train import lr_at
from lssar.train.config import TrainConfig, default_run_name, load_config, model_config

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------- config


def test_config_precedence_and_types(tmp_path: Path) -> None:
    toml = tmp_path / "mine.toml"
    toml.write_text('n_layer = 3\nlr = 1\nattn = "lssa"\n')
    cfg = load_config(
        str(toml),
        [
            "--n_layer=5",
            "max-steps=7",
            "--attn_p=15",
            "--compile=true",
            "--data_dir=none",
            "--run_name=x",
        ],
    )
    assert (cfg.n_layer, cfg.max_steps, cfg.attn, cfg.attn_p) == (5, 7, "lssa", 15.0)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # TOML int -> float field
    assert cfg.compile is True and cfg.data_dir is None and cfg.run_name == "x"
    assert cfg.n_embd == TrainConfig.n_embd  # untouched default
    preset = load_config("tiny-cpu")
    assert preset.preset == "tiny-cpu" and preset.n_embd == 128 and preset.tokenizer == "byte"
    assert load_config("tiny-cpu", {"n_embd": 64}).n_embd == 64
    assert default_run_name(load_config("tiny-cpu", {"attn": "lssar", "attn_p": 3})) == (
        "tiny-cpu-lssar-p3-s0"
    )
    assert default_run_name(TrainConfig(attn="lssa", seed=2)) == "custom-lssa-s2"
    alibi = load_config("tiny-cpu", ["--pos=alibi"])
    assert alibi.pos == "alibi" and default_run_name(alibi) == "tiny-cpu-softmax-alibi-s0"
    assert model_config(alibi, 256).pos == "alibi"


def test_a_run_from_before_pos_resumes_as_rope(tmp_path: Path) -> None:
    """A stored config without ``pos`` (runs before it existed) is the same config as one with
    the default ``pos="rope"``, and differs from ``pos="alibi"``."""
    from lssar.train.runs import check_same_config

    cfg = TrainConfig()
    old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "pos"}
    check_same_config(old, cfg, tmp_path)
    with pytest.raises(ValueError, match="pos: 'rope' \\(run\\) != 'alibi' \\(now\\)"):
        check_same_config(old, dataclasses.replace(cfg, pos="alibi"), tmp_path)


@pytest.mark.parametrize(
    ("preset", "overrides", "match"),
    [
        (None, ["--lrr=1"], r"unknown config key 'lrr'.*did you mean lr"),
        (None, ["--max_steps=ten"], r"max_steps: expected int"),
        (None, ["--compile=maybe"], r"compile: expected bool"),
        (None, {"n_layer": 2.5}, r"n_layer: expected int"),
        (None, ["max_steps"], r"expected --key=value"),
        ("nope", None, r"unknown preset 'nope'.*tiny-cpu"),
        (None, ["--attn=nope"], r"unknown attention variant 'nope'"),
        (None, ["--attn=relu", "--attn_p=2"], r"takes no option 'p'"),
        (None, ["--attn=lssar", "--attn_p=-1"], r"p must be a float in \[2\^-126, 2\^28\]"),
        (None, ["--n_embd=100", "--n_head=3"], r"divisible by n_head"),
        (None, ["--dtype=fp16"], r"dtype='fp16'"),
        # once accepted, then "val loss nan" with exit 0, or a failure at the first step
        (None, ["--lr=nan"], r"lr=nan must be a finite number > 0"),
        (None, ["--lr=inf"], r"lr=inf must be a finite number"),
        (None, ["--weight_decay=nan"], r"weight_decay=nan must be a finite number >= 0"),
        (None, ["--weight_decay=inf"], r"weight_decay=inf must be a finite"),
        (None, ["--beta2=1"], r"beta2=1.0 must be in \[0, 1\)"),
        (None, ["--grad_clip=nan"], r"grad_clip=nan must be a finite"),
        (None, ["--rope_base=0"], r"rope_base=0.0 must be > 0"),
        (None, ["--rope_base=-5"], r"rope_base=-5.0 must be > 0"),
        (None, ["--n_head=0"], r"n_head=0 must be a whole number >= 1"),
        (None, ["--n_embd=-128"], r"n_embd=-128 must be"),
        (None, ["--mlp_ratio=0"], r"mlp_ratio=0.0 must be > 0"),
        (None, ["--mlp_ratio=-2"], r"mlp_ratio=-2.0 must be > 0"),
        (None, ["--n_kv_head=0"], r"n_kv_head=0 must be"),
        (None, ["--n_kv_head=-2"], r"n_kv_head=-2 must be"),
        (None, ["--seed=-1"], r"seed >= 0"),
        (None, ["--attn=lssar", "--attn_impl=sdpa"], r"impl 'sdpa' does not run variant 'lssar'"),
        (None, ["--attn_impl=chunked", "--attn=lssa", "--dropout=0.1"], r"has no dropout"),
        (None, ["--run_name=../elsewhere"], r"run_name='../elsewhere' must be a plain name"),
        (None, ["--run_name=/tmp/abs"], r"run_name='/tmp/abs' must be a plain name"),
        (None, ["--run_name=.."], r"run_name='..' must be a plain name"),
        (None, ["--pos=xpos"], r"unknown pos 'xpos'; choose one of: rope, alibi, nope"),
        (None, ["--pos=alibi", "--attn=lssar"], r"pos='alibi' biases the scores of the softmax"),
        (None, ["--doc-mask=true"], r"doc_mask cuts batches at the EOT token, and the byte"),
    ],
)
def test_config_errors(preset: str | None, overrides, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(preset, overrides)


def test_override_parser() -> None:
    from lssar.train.config import parse_overrides, parse_value

    argv = ["--max-steps", "5", "--compile", "--lr=0.1", "--attn_p=none"]
    want = {"max_steps": "5", "compile": "true", "lr": "0.1", "attn_p": "none"}
    assert parse_overrides(argv, cli=True) == want
    assert parse_overrides(["max_steps=5", "--max_steps=6"]) == {"max_steps": "6"}
    with pytest.raises(ValueError, match="settings are --key=value"):
        parse_overrides(["max_steps=5"], cli=True)
    assert parse_value("k", "3", float) == 3.0 and parse_value("k", "none", int | None) is None
    assert parse_value("k", "(0.5, 2.0)", tuple[float, float]) == (0.5, 2.0)
    assert parse_value("k", "[0, 1]", list[int]) == [0, 1]
    with pytest.raises(ValueError, match="k: expected int"):
        parse_value("k", "1.5", int)


def test_lr_schedule() -> None:
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55) and lr_at(110, cfg) == pytest.approx(0.1)


def test_dtype_auto_uses_bf16_on_cpu_only_when_native(monkeypatch: pytest.MonkeyPatch) -> None:
    from lssar.train import loop as train_mod

    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda n=native: n)
        assert train_mod._use_bf16("auto", cpu) is native
        assert train_mod._use_bf16("bf16", cpu) and not train_mod._use_bf16("fp32", cpu)

    def broken() -> bool:
        raise RuntimeError("no oneDNN")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", broken)
    assert not train_mod._use_bf16("auto", cpu)
