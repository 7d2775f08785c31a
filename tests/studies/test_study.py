"""Tests for the shape every study shares (lssar.studies.common: Study, study_parser)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lssar.cli import main
from lssar.studies.common import Study, study_args, study_parser


@dataclass
class Squares(Study):
    """A study of squares: one unit per (seed, number), the report a file of results."""

    seeds: list[int]
    out: Path

    def units(self) -> list[tuple[Any, ...]]:
        return [(s, n) for s in self.seeds for n in (1, 2, 3)]

    def run_unit(self, seed: int, n: int) -> int:
        return seed * 100 + n * n

    def write_report(self, results: list[Any], seconds: float) -> Path:
        self.out.write_text(" ".join(map(str, results)))
        return self.out


def test_a_study_runs_its_units_in_order_then_writes_the_report(tmp_path: Path) -> None:
    seen: list[int] = []
    done = Squares([0, 1], tmp_path / "r.txt").run(on_done=lambda i, r: seen.append(i))
    assert done.report.read_text() == "1 4 9 101 104 109"
    assert done.results == [1, 4, 9, 101, 104, 109] and seen == list(range(6))


def test_the_shared_flags_and_old_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    ap = study_parser("x", None, {}, ["a", "b"], "runs/x", "reports/x", {"--runs-dir": "--runs"})
    args = ap.parse_args(["--arms", "a, b", "--seeds", "0,2", "--runs-dir", "R", "--jobs", "2"])
    assert study_args(args) == (["a", "b"], [0, 2]) and args.runs == "R" and args.out is None
    assert "note: --runs-dir is deprecated, use --runs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--seeds 'x': expected integers like 0,1,2"):
        study_args(ap.parse_args(["--seeds", "x"]))
    with pytest.raises(ValueError, match="--jobs 0: need at least 1 worker"):
        study_args(ap.parse_args(["--jobs", "0"]))


def test_every_study_takes_the_shared_flags(tmp_path: Path, capsys) -> None:
    """The paper preset only prints its commands: --runs (and the old --runs-dir) reach them."""
    for flag in ("--runs", "--runs-dir"):
        assert main(["reproduce", "--preset", "paper", flag, str(tmp_path / "r")]) == 0
        out, err = capsys.readouterr()
        assert f"--out_dir={tmp_path / 'r'}" in out
        assert ("deprecated" in err) == (flag == "--runs-dir")
    for cmd in ("reproduce", "recall", "orbits", "convert-study"):
        assert main([cmd, "--seeds", "one", "--runs", str(tmp_path / "r")]) == 2
        assert "--seeds 'one': expected integers" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        shown = capsys.readouterr().out
        for flag in ("--preset", "--arms", "--seeds", "--jobs", "--runs", "--out", "--no-progress"):
            assert flag in shown, (cmd, flag)
    assert not (tmp_path / "r").exists()
