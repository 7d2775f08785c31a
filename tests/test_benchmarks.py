"""The benchmark scripts run as a user runs them and print every row of their tables (tiny sizes;
the timings themselves live in benchmarks/RESULTS.md, never in tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        # this checkout's package: a script's own folder leads sys.path, so without it the
        # scripts import whatever checkout the venv's editable install points at
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _table_rows(text: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r] for r in rows if not r[0].strip().startswith(("dtype", "att"))]


def test_attention_benchmark_prints_every_case_with_ratios():
    spec = util.spec_from_file_location("bench_attention", ROOT / "benchmarks" / "attention.py")
    bench = util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = _run(
        "attention.py", "--lengths", "64", "--dtypes", "fp32", "--repeats", "1", "--threads", "1"
    )
    rows = _table_rows(out)[: len(bench.CASES)]  # printed as measured, then again as one table
    assert [r[2] for r in rows] == [c[0] for c in bench.CASES]
    assert rows[0][4] == "1.00" and rows[0][6] == "1.00"  # SDPA is the baseline
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    assert rows[-1][5] == "-"  # the GEMM floor has no backward
    assert "threads 1" in out


def test_train_throughput_benchmark_prints_every_arm():
    out = _run(
        "train_throughput.py",
        *("--seq-len", "32", "--batch-size", "2", "--steps", "1", "--rounds", "1"),
        *("--warmup", "1", "--dtypes", "fp32", "--attn", "softmax,lssar:cpu,lssar:chunked"),
    )
    rows = _table_rows(out)
    assert [r[0] for r in rows] == ["softmax", "lssar:cpu", "lssar:chunked"]
    assert rows[0][4] == "1.00x" and all(float(r[2]) > 0 for r in rows)
