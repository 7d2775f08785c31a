"""Help that teaches: every option and setting of ``lssar train``, ``eval``, ``reproduce``,
``recall`` and ``orbits`` has a one-line description, its type and default, and its choices."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from lssar.cli import main
from lssar.clihelp import undescribed
from lssar.ops.registry import IMPLS
from lssar.ops.variants import VARIANTS
from lssar.positions import POSITIONS
from lssar.train.config import KEY_HELP, TrainConfig


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_train_key_is_described_with_type_default_and_choices(capsys):
    assert undescribed(TrainConfig, KEY_HELP) == []
    text = _help(capsys, "train")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "preset":  # the --preset flag
            continue
        entry = re.search(rf"^  --{f.name}=(\S+)\s+(.*?)(?=^  --|\Z)", text, re.M | re.S)
        assert entry, f.name
        body = " ".join(entry[2].split())
        assert body.startswith(" ".join(KEY_HELP[f.name].split())[:40]), f.name
        assert re.search(r"\((int|float|str|bool)( or none)?; default: [^)]+\)$", body), body
    assert "--pos={" + ",".join(POSITIONS) + "}" in text
    assert "--attn={" + ",".join(VARIANTS) + "}" in text
    assert "--attn_impl={" + ",".join(["auto", *IMPLS]) + "}" in text
    assert "--dtype={auto,bf16,fp32}" in text and "--compile={true,false}" in text
    assert "bpe-<N>" in text and "hf:<dataset>[:<config>][:<split>]" in text  # the forms
    assert "tiny-cpu" in text  # the shipped presets


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from lssar.studies.lm import evaluate
    from lssar.studies.lm import study as lm
    from lssar.studies.orbits import study as orbits
    from lssar.studies.recall import study as recall

    return {
        "eval": evaluate.parser(),
        "reproduce": lm.parser(),
        "recall": recall.parser(),
        "orbits": orbits.parser(),
    }


@pytest.mark.parametrize("command", ["eval", "reproduce", "recall", "orbits"])
def test_every_option_of_the_study_commands_is_described(capsys, command):
    ap = _parsers()[command]
    for action in ap._actions:
        assert action.help and "\n" not in action.help, (command, action.dest)
    text = _help(capsys, command)
    for action in ap._actions:
        if action.help == argparse.SUPPRESS:  # an old spelling, kept working but not shown
            assert action.option_strings[0] not in text, action.option_strings
        elif action.option_strings and action.dest != "help":
            flag = action.option_strings[0]
            assert re.search(rf"{flag}\b.*?\((flag|int|float|str)", text, re.S), flag
    if command in ("reproduce", "recall", "orbits"):
        assert "--preset {quick," in text and "presets:\n  quick " in text


def test_every_set_key_of_recall_and_orbits_is_described(capsys):
    from lssar.studies.orbits import kepler
    from lssar.studies.orbits import presets as orbits
    from lssar.studies.recall import presets as recall
    from lssar.studies.recall.task import RecallTask

    assert undescribed(recall.StudyConfig, recall.SET_HELP, recall.SET_SKIP) == []
    assert undescribed(RecallTask, recall.TASK_HELP) == []
    assert undescribed(orbits.Preset, orbits.SET_HELP, orbits.SET_SKIP) == []
    assert undescribed(kepler.OrbitConfig, orbits.DATA_HELP) == []
    text = _help(capsys, "recall")
    assert "  steps=INT " in text and "  task.pair_order={kv,vk}" in text
    assert "(tuple[int, ...]; default: (1, 2, 4, 8, 16))" in " ".join(text.split())
    text = _help(capsys, "orbits")
    assert "  fmt={continuous,discrete}" in text and "  data.n_systems=INT " in text


def test_undescribed_finds_missing_and_stray_descriptions():
    @dataclasses.dataclass
    class Settings:
        a: int = 1
        b: float = 2.0

    assert undescribed(Settings, {"a": "the a"}) == ["b"]
    assert undescribed(Settings, {"a": "the a", "b": "", "c": "no such key"}) == ["b", "c"]
    assert undescribed(Settings, {"a": "two\nlines", "b": "x"}) == ["a"]
