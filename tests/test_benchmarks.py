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
    # this checkout's lssar, whichever checkout the environment's editable install points at
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
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
    assert rows[-1][5] == "-"  # the GEMMs alone have no backward
    assert "threads 1" in out and "flags " in out and "clock wall" in out


def test_train_throughput_benchmark_prints_every_arm():
    out = _run(
        "train_throughput.py",
        *("--seq-len", "32", "--batch-size", "2", "--steps", "1", "--rounds", "1"),
        *("--warmup", "1", "--dtypes", "fp32", "--attn", "softmax,lssar:cpu,lssar:chunked"),
    )
    rows = _table_rows(out)
    assert [r[0] for r in rows] == ["softmax", "lssar:cpu", "lssar:chunked"]
    assert rows[0][4] == "1.00x" and all(float(r[2]) > 0 for r in rows)


def test_decode_benchmark_prints_every_case_and_generate_arm():
    spec = util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "decode.py")
    bench = util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports attention.py as a script does
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = _run("decode.py", "--quick", "--threads", "1")
    rows = _table_rows(out)
    cases = [c[0] for c in bench.CPU_CASES if c[2] != "flex"]  # --quick leaves flex out
    cases.append(bench.FLOOR)  # reading the step's K and V once
    steps = [r for r in rows if r[0] == "fp32"]
    assert [r[3] for r in steps] == cases * 4  # T_q = 1 and 8, as measured and in the table
    assert {(r[1], r[2]) for r in steps} == {("1", "256"), ("8", "256")}
    assert all(r[6] == "1.00" for r in steps if r[3] == cases[0])  # SDPA is the baseline
    assert all(r[8] == "1.00" for r in steps if r[3] == bench.FLOOR)  # floor / time
    assert all(float(r[5]) > 0 and float(r[8]) > 0 for r in steps)
    auto = next(r for r in steps if r[3] == "lssar p=15 auto")
    assert auto[4] in ("reference", "cpu", "cpu decode entry", "chunked")  # what auto picked
    gen = [r for r in rows if r[0] in ("GPT", "HF Llama")]
    arms = [f"GPT {a[0]}" for a in bench.GPT_ARMS]
    if "HF Llama rows skipped" not in out:  # transformers is optional
        arms += [f"HF Llama {a[0]}" for a in bench.HF_ARMS]
    assert [f"{r[0]} {r[1]}" for r in gen] == arms * 2
    assert all(float(r[5]) > 0 for r in gen)
    assert "threads 1" in out and "wait for a device" in out
