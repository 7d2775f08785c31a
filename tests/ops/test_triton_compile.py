"""The Triton kernels compiled for real GPUs (sm_80, sm_90) on a machine without one.

The compiles run in a subprocess with ``TRITON_INTERPRET`` removed from its environment: the
rest of the suite (``tests/conftest.py``) decorates the kernels for the interpreter in this
process, so this file and ``tests/ops/test_triton_kernels.py`` pass in one run in either order.
The default run compiles, for each kernel of each case of the reduced grid, the config the
autotuner may pick that is closest to spilling by the kernels' own estimate, for sm_80 and sm_90
(64 builds, one case with key spans and sinks, one with ``precise=False``), and a few targeted
builds (a known spilling tile, fp32 rows with sinks, fp32 with and without TF32, the sm_90 wgmma
dk/dv tiles): 77 builds (69 before the ``precise=False`` case: 149 s measured cold on 2 busy
cores, 228 s on a busier day, 9.5 minutes once on 2 overloaded ones; 16 s warm), cached per
build under ``$LSSAR_COMPILE_CACHE`` or ``~/.cache/lssar/compile_check``; ``-m slow`` compiles
every config of the full grid (hours on 2 cores).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


ROOT = Path(__file__).resolve().parents[2]


def _python(code_or_args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=tmp, env=env, capture_output=True, text=True
    )


def _run_json(tmp: Path, body: str) -> dict:
    """``body`` run in a fresh interpreter with ``json`` and ``compile_check as cc`` imported;
    the JSON of its last printed line."""
    code = "import json; from lssar.ops.triton.devtools import compile_check as cc\n" + body
    proc = _python(["-c", code], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(tmp: Path, *flags: str) -> tuple[list[dict], str]:
    out = tmp / "rows.json"
    proc = _python(["-m", "lssar.ops.triton.compile_check", *flags, "--json", str(out)], tmp)
    if not out.exists():
        pytest.fail(f"compile check crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> tuple[list[dict], str]:
    return _check(tmp_path_factory.mktemp("cc"), "--grid", "reduced", "--riskiest", "1")


def _assert_clean(rows: list[dict], report: str) -> None:
    from lssar.ops.triton.devtools.compile_check import problems

    bad = problems(rows)
    assert not bad, "\n".join(bad) + "\n\n" + report[-6000:]


def test_reduced_grid_covers_every_kernel_and_arch(reduced):
    rows, _ = reduced
    kernels = {"fwd", "fwd-train", "rows", "dq", "dkdv", "decode1", "decode2"}
    assert {r["kernel"] for r in rows} == kernels
    assert {r["arch"] for r in rows} == {80, 90}
    assert all(r["kept"] for r in rows)
    # LSSAR's inference forward, its forward for a backward (F_i folded in), and the default
    # backward (dq fused into dk/dv): row coefficients, dk/dv; the deterministic one adds dq
    default = {"fwd", "fwd-train", "rows", "dkdv"}
    # key spans with sinks (HAS_SPANS, HAS_SINKS): every kernel, both archs
    assert {(r["kernel"], r["arch"]) for r in rows if r["spans"] == "sinks"} == {
        (k, a) for k in default for a in (80, 90)
    }
    # precise=False (SPLIT=False: half-precision weights rounded once): every kernel, both archs
    assert {(r["kernel"], r["arch"]) for r in rows if not r["precise"]} == {
        (k, a) for k in default for a in (80, 90)
    }
    assert {(r["kernel"], r["arch"]) for r in rows if r["deterministic"]} == {
        (k, a) for k in default | {"dq"} for a in (80, 90)
    }


def test_precise_option_reaches_the_kernels(tmp_path):
    # a case's precise is the host's option: SPLIT in every half-precision launch it records
    # with a matrix product (the rows kernel has none: per-row coefficients only)
    out = _run_json(
        tmp_path,
        "print(json.dumps({str(p): sorted({ln.kwargs['SPLIT'] for ln in cc.launches("
        "cc.Case(128, 'bf16', True, 'lssar', False, precise=p)) if ln.name != 'rows'})"
        " for p in (True, False)}))",
    )
    assert out == {"True": [True], "False": [False]}


def test_reduced_grid_compiles_within_resources_without_spills(reduced):
    _assert_clean(*reduced)


def test_sm90_half_precision_main_loops_use_wgmma(reduced):
    # wgmma needs M % 64 == 0: a config whose MMA tiles are all shorter is exempt (in fwd, rows
    # and dq every product has M = BM, so a 16x64 tile runs HMMA; dk/dv has products with M = BM
    # and M = BN); the LSSA rows kernel has no matrix product at all. Held over the full grid's
    # kept builds and the fast grid's riskiest (564 sm_90 builds with a 64-row product: all HGMMA).
    rows, _ = reduced
    checked = 0
    for r in rows:
        if r["kernel"] == "rows":  # per-row work only, no matrix product
            continue
        bm, bn = (int(x) for x in r["config"].split()[0].split("x"))
        m = max(bm, bn) if r["kernel"] == "dkdv" else bm
        if r["arch"] != 90 or r["dtype"] == "fp32" or m < 64:
            continue
        checked += 1
        assert r["hgmma"] > 0, f"{r['case']} {r['kernel']} {r['config']}: no HGMMA"
    assert checked > 0


def test_spilling_config_is_detected(tmp_path):
    # The check must be able to fail (a planted regression): a tile measured to spill (the LSSAR
    # training forward at head dim 128, bf16, precise=False, 128x64, 8 warps, 2 stages on sm_90:
    # 255 registers and 124 B spill stores; the inference forward in the same tile does not
    # spill) is compiled, flagged by problems() when the autotuner could pick it, and the
    # autotuner's pruning must not keep it.
    res = _run_json(
        tmp_path,
        "case = cc.Case(128, 'bf16', True, 'lssar', False, precise=False)\n"
        "b = [x for x in cc.builds([case], (90,))\n"
        "     if x.kernel == 'fwd-train' and x.config == '128x64 w8 s2']\n"
        "kept = b[0].kept\n"
        "b[0].kept = True\n"
        "rows = cc.run(b, 1)\n"
        "print(json.dumps({'kept': kept, 'rows': rows, 'problems': cc.problems(rows)}))\n",
    )
    row = res["rows"][0]
    assert row["ok"] and row["spill_store"] > 0, row
    assert any("spills" in p for p in res["problems"])
    assert not res["kept"], "the autotuner may pick a config that spills"


def test_tf32_flag_puts_fp32_dots_on_tensor_cores(tmp_path):
    # torch.backends.cuda.matmul.allow_tf32 (recorded through host.py, as a launch reads it)
    # reaches every kernel: with it, the kept config closest to spilling of each kernel, fp32
    # LSSAR at head dim 128, multiplies on tensor cores (HMMA on sm_80, HGMMA on sm_90 where a
    # tile has 64 rows) without spilling; without it the same kernels have no tensor-core
    # instruction (IEEE fp32 on FMA units).
    res = _run_json(
        tmp_path,
        "out = {}\n"
        "for tf32 in (False, True):\n"
        "    case = cc.Case(128, 'fp32', True, 'lssar', False, tf32=tf32)\n"
        "    rows = cc.run(cc.builds([case], (80, 90), riskiest=1), 2)\n"
        "    out[str(tf32)] = {'rows': rows, 'problems': cc.problems(rows)}\n"
        "print(json.dumps(out))\n",
    )
    for mode in ("False", "True"):
        assert not res[mode]["problems"], res[mode]["problems"]
        assert {(r["kernel"], r["arch"]) for r in res[mode]["rows"]} == {
            # fp32 keeps the dq kernel (the fused dq spilled in its FMA-unit dk/dv tiles)
            (k, a)
            for k in ("fwd", "fwd-train", "rows", "dq", "dkdv")
            for a in (80, 90)
        }
    for r in res["False"]["rows"]:
        assert r["hmma"] == r["hgmma"] == 0, r
    for r in res["True"]["rows"]:
        if r["kernel"] == "rows":  # per-row work, no product
            continue
        assert r["hmma"] + r["hgmma"] > 0, r
        bm = int(r["config"].split("x")[0])
        if r["arch"] == 90 and r["kernel"] != "dkdv" and bm >= 64:
            assert r["hgmma"] > 0, r
        if r["arch"] == 80:
            assert r["hgmma"] == 0 and r["hmma"] > 0, r
    assert any(r["hgmma"] > 0 for r in res["True"]["rows"])


# the dk/dv tiles for sm_90's wgmma (key-major scores; at head dim 128 one gradient per program,
# precise=False)
WGMMA_DKDV = {64: "32x64 w4 s2 key-major", 128: "16x64 w4 s2 key-major one-grad"}


def test_wgmma_dkdv_tiles_compile_to_hgmma_without_spills(tmp_path):
    # kept by the autotuner's pruning, every product on HGMMA (no HMMA left), no spill: sm_90,
    # bf16 LSSAR p=15 causal, precise=False, dq fused (the default), head dim 64 (both
    # gradients) and 128 (one gradient): 2 builds
    res = _run_json(
        tmp_path,
        f"tiles = {WGMMA_DKDV!r}\n"
        "out = []\n"
        "for d, label in tiles.items():\n"
        "    case = cc.Case(d, 'bf16', True, 'lssar', False, precise=False)\n"
        "    blds = cc.builds([case], (90,))\n"
        "    out += cc.run([b for b in blds if (b.kernel, b.config) == ('dkdv', label)], 1)\n"
        "print(json.dumps(out))\n",
    )
    assert {r["head_dim"]: r["config"] for r in res} == WGMMA_DKDV
    for r in res:
        assert r["ok"] and r["kept"], r
        assert r["spill_store"] == r["spill_load"] == 0, r
        # q k^T, dO v^T, P^T dO, dS^T q and the fused dq as k^T dS^T
        assert r["hmma"] == 0 and r["hgmma"] >= 5, r
        assert r["loop"]["hmma"] == 0 and r["loop"]["hgmma"] >= 5, r


def test_wgmma_dkdv_tiles_are_kept_only_where_measured_clean():
    import torch

    from lssar.ops.triton import autotune as A
    from lssar.ops.triton.devtools.compile_check import _config_label

    def kept(bd, dtype=torch.bfloat16, ieee=False, split=False, mask=False):
        args = {"Q": torch.zeros(1, dtype=dtype)}
        kw = dict(BD=bd, BDV=bd, IEEE=ieee, SPLIT=split, HAS_MASK=mask)
        cfgs = A._pruner("dkdv")(A._COL_CONFIGS, args, **kw)
        return {label for label in map(_config_label, cfgs) if "key-major" in label}

    one_grad = {
        "16x64 w4 s2 key-major one-grad",
        "32x64 w4 s2 key-major one-grad",
        "32x128 w8 s2 key-major one-grad",
    }
    both = {"16x64 w4 s2 key-major", "32x64 w4 s2 key-major", "32x128 w8 s2 key-major"}
    assert kept(64) == one_grad | both
    # 32 rows, both gradients: precise=False and plain launches only
    assert kept(64, split=True) == kept(64, mask=True) == one_grad | {"16x64 w4 s2 key-major"}
    assert kept(128) == {WGMMA_DKDV[128]} and kept(128, torch.float16) == {WGMMA_DKDV[128]}
    assert kept(128, split=True) == set()  # spilled 4-12 B with the hi + lo products
    assert kept(256) == set()
    assert kept(64, torch.float32, ieee=True) == kept(64, torch.float32) == set()  # IEEE, TF32


@pytest.mark.slow
def test_full_grid_every_config(tmp_path):
    # every config (kept or not) compiles; the kept ones fit and do not spill
    rows, report = _check(tmp_path, "--grid", "full")
    assert all(r["ok"] for r in rows), report[-6000:]
    _assert_clean(rows, report)


def test_an_unreadable_cache_entry_is_rebuilt_and_said_once(tmp_path):
    """A truncated, edited or foreign entry used to crash the check (JSONDecodeError,
    KeyError, TypeError, naming no file) until the cache was deleted by hand. Here each kind is
    a miss: rebuilt (a stand-in compiler records what it is asked for), overwritten, one line."""
    res = _run_json(
        tmp_path,
        "import contextlib, io, pathlib\n"
        "blds = cc.builds(cc.grid('reduced')[:1], (80,), riskiest=1)\n"
        "cache, asked = pathlib.Path('cache'), []\n"
        "def fake(b):\n"
        "    asked.append(b.key)\n"
        "    return {'ok': True, 'seconds': 0.0, 'shared': 1024, 'regs': 64, 'spill_store': 0,\n"
        "            'spill_load': 0, **cc.opcode_counts([]), 'loop': cc.loop_counts([])}\n"
        "cc.run(blds, 1, cache, fake)\n"
        "first, asked[:] = list(asked), []\n"
        "keys = sorted({b.key for b in blds})\n"
        'bad = [\'{"ok": tr\', \'{"ok": true}\', \'[1, 2]\', \'{"ok": true, "shared": "1"}\']\n'
        "for key, text in zip(keys, bad):\n"
        "    (cache / f'{key}.json').write_text(text)\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    rows = cc.run(blds, 1, cache, fake)\n"
        "again = cc.run(blds, 1, cache, fake)\n"
        "print(json.dumps({'first': first, 'keys': keys, 'asked': asked, 'err': err.getvalue(),\n"
        "                  'problems': cc.problems(rows), 'table': cc.table(rows),\n"
        "                  'same': rows == again}))\n",
    )
    keys = res["keys"]
    assert len(keys) == 4 and sorted(res["first"]) == keys
    assert sorted(res["asked"]) == keys  # each unreadable entry rebuilt, once
    assert res["err"].count("\n") == 1 and "4 unreadable cache entries" in res["err"]
    assert "rebuilt and overwritten" in res["err"] and any(k in res["err"] for k in keys)
    assert res["problems"] == [] and res["same"]
