"""The fused C++ CPU kernel (impl="cpu"): it really runs, it is cached, and without a compiler
the same call runs chunked's eager path after one warning. Its accuracy is held to the float64
reference by the registry-generated grids in test_attention.py and test_robustness.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import lssar
from lssar.ops import chunked, registry
from lssar.ops.cpu import build as cpu_kernel


def _qkv(b=2, h=2, t=150, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=g) for _ in range(3)]


def _run(impl, q, k, v, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = lssar.attention(q, k, v, impl=impl, **kw)
    out.square().sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def test_auto_uses_the_fused_kernel_on_cpu():
    q = torch.empty(1, 2, 256, 16)
    assert registry.resolve("lssar", "auto", q, q, 0.0, {}).impl == "cpu"
    assert cpu_kernel.kernel() is not None, "make setup builds the kernel on this machine"


@pytest.mark.parametrize("p", [None, 15.0, 3.0, 2.5, 1.0])
def test_cpu_runs_the_kernel_not_the_eager_path(monkeypatch, p):
    q, k, v = _qkv()
    mask = torch.arange(150) < torch.tensor([150, 97]).reshape(2, 1, 1, 1)
    opts = {"variant": "lssa" if p is None else "lssar", "is_causal": True, "attn_mask": mask}
    if p is not None:
        opts["p"] = p
    eager = _run("chunked", q, k, v, **opts)

    def no_eager(*a, **kw):
        raise AssertionError("the eager path ran")

    monkeypatch.setattr(chunked, "_weights", no_eager)
    fused = _run("cpu", q, k, v, **opts)
    for a, b in zip(fused, eager):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


def test_kernel_is_built_once_and_cached():
    first = cpu_kernel.kernel()
    assert cpu_kernel.kernel() is first
    assert first.__name__ == cpu_kernel.entry_name()  # keyed by source + environment
    assert (cpu_kernel.entry_dir() / f"{first.__name__}{cpu_kernel.LIB_SUFFIX}").exists()


def test_no_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    """A machine that cannot build the kernel: the real build fails, one warning, same results."""
    q, k, v = _qkv(seed=1)
    expected = _run("chunked", q, k, v, variant="lssar", is_causal=True)
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.warns(RuntimeWarning, match="could not be built.*eager chunked path") as caught:
        got = _run("cpu", q, k, v, variant="lssar", is_causal=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second call does not warn again
            _run("cpu", q, k, v, variant="lssar", is_causal=True)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", cpu_kernel.runnable_isas())
def test_every_isa_build_matches_the_eager_path(monkeypatch, isa):
    """The kernel is compiled per ISA (8 or 16 float lanes, other row tails): each build this
    machine can run gives the eager results, forward and backward, masked and causal."""
    monkeypatch.setattr(cpu_kernel, "_loaded", {"mod": cpu_kernel.load(isa=isa)})
    q, k, v = _qkv(t=75, seed=4)  # 75 keys: full vectors plus a tail for 8 and 16 lanes
    mask = torch.arange(75) < torch.tensor([75, 40]).reshape(2, 1, 1, 1)
    for opts in ({"variant": "lssa"}, {"variant": "lssar"}, {"variant": "lssar", "p": 2.5}):
        for causal in (False, True):
            kw = {**opts, "is_causal": causal, "attn_mask": mask}
            for a, b in zip(_run("cpu", q, k, v, **kw), _run("chunked", q, k, v, **kw)):
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
    # the decode entry (3 queries, no gradient), on float32 and half-precision caches, which it
    # converts as it reads them (F16C for fp16 in the AVX2 build)
    key_mask = mask[:, :, -1:]  # (2, 1, 1, 75): the second sequence sees its first 40 keys
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        qd, kd, vd = q[..., -3:, :].to(dtype), k.to(dtype), v.to(dtype)
        for opts in ({"variant": "lssa"}, {"variant": "lssar"}, {"variant": "lssar", "p": 2.5}):
            with torch.no_grad():
                a, b = (
                    lssar.attention(qd, kd, vd, key_mask, is_causal=True, impl=impl, **opts)
                    for impl in ("cpu", "chunked")
                )
            assert (a - b).abs().max() <= tol * b.abs().max()


def test_isa_switch_picks_the_build_and_rejects_what_the_machine_cannot_run(monkeypatch):
    for isa in cpu_kernel.runnable_isas():
        monkeypatch.setattr(cpu_kernel, "_loaded", {})
        monkeypatch.setenv(cpu_kernel.ISA_ENV, isa)
        assert cpu_kernel.kernel().__name__ == cpu_kernel.entry_name(isa)
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv(cpu_kernel.ISA_ENV, "NEON")
    with pytest.raises(ValueError, match="LSSAR_CPU_KERNEL_ISA='NEON' is not a vector ISA"):
        cpu_kernel.kernel()


def test_disable_switch_uses_the_eager_path(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "1")
    assert cpu_kernel.kernel() is None


@pytest.mark.parametrize("p", [None, 15.0, 2.5])
def test_key_tiles_add_up_to_the_whole_row(p):
    """The forward's key tiling (LSSA's default; LSSAR's two-pass form, whose scores are
    recomputed per tile) gives the one-tile result, with a mask, causal, T_q != T_k."""
    from lssar.ops.common import REWEIGHT_MIN_KEYS, uniform_tolerance, unit

    mod = cpu_kernel.kernel()
    g = torch.Generator().manual_seed(3)
    b, h, tq, tk, d = 2, 3, 37, 53, 16
    q = unit(torch.randn(b, h, tq, d, generator=g))
    k = unit(torch.randn(b, h, tk, d, generator=g))
    v = torch.randn(b, h, tk, d, generator=g)
    mask = (torch.rand(b, 1, tq, tk, generator=g) > 0.3).expand(b, h, tq, tk)
    rule = (-1.0 if p is None else p, float(REWEIGHT_MIN_KEYS), uniform_tolerance(torch.float32))
    args = (mask, h, True, 4.16, True, *rule, 16)
    whole, uf1 = mod.forward(q, k, v, *args, tk, None, None)
    tiled, uf2 = mod.forward(q, k, v, *args, 16, None, None)
    assert not uf1 and not uf2
    # the same sums in another order (tiles of 16 keys; AVX2 adds 8 lanes, AVX-512 16): the
    # rounding scales with the outputs' size, not a fixed 1e-6 (AVX2 erred 1.9e-6 at |out| ~ 4)
    assert torch.allclose(tiled, whole, rtol=1e-5, atol=1e-6 * whole.abs().max().item())


@pytest.mark.parametrize("p", [None, 15.0])
def test_backward_row_blocks_add_up(p):
    """The backward's blocks of query rows (causal: 32 rows, so no block computes the triangle
    above its diagonal) give the one-block gradients, with a mask, causal, T_q != T_k, and rows
    before the first key (T_q > T_k: zero gradient)."""
    from lssar.ops.common import REWEIGHT_MIN_KEYS, uniform_tolerance, unit

    mod = cpu_kernel.kernel()
    g = torch.Generator().manual_seed(4)
    b, h, d = 2, 3, 16
    rule = (-1.0 if p is None else p, float(REWEIGHT_MIN_KEYS), uniform_tolerance(torch.float32))
    for tq, tk in ((70, 53), (37, 90)):
        q = unit(torch.randn(b, h, tq, d, generator=g))
        k = unit(torch.randn(b, h, tk, d, generator=g))
        v, grad = torch.randn(b, h, tk, d, generator=g), torch.randn(b, h, tq, d, generator=g)
        mask = (torch.rand(b, 1, tq, tk, generator=g) > 0.3).expand(b, h, tq, tk)
        args = (grad, q, k, v, mask, h, True, 4.16, True, *rule)
        *whole, uf1 = mod.backward(*args, tq, None, None)
        for rows in (7, chunked.FUSED_CAUSAL_ROWS):
            *blocks, uf2 = mod.backward(*args, rows, None, None)
            assert not uf1 and not uf2
            for a, w in zip(blocks, whole):
                assert torch.allclose(a, w, rtol=1e-5, atol=1e-6 * w.abs().max().item())
        if tq > tk:
            assert (whole[0][:, :, : tq - tk] == 0).all()


def test_kernel_reads_a_models_strided_views_in_place(monkeypatch):
    """q, k, v as a model makes them (views of one [B, T, 3 C] projection, transposed to
    [B, H, T, D]) and the gradient of a transposed output are read in place, not copied, and
    give what contiguous copies of them give."""
    b, t, h, d = 2, 70, 3, 16
    x = torch.randn(b, t, 3 * h * d, generator=torch.Generator().manual_seed(6))
    proj = torch.randn(h * d, 5, generator=torch.Generator().manual_seed(7))
    kept = []
    real = chunked._kernel_view
    monkeypatch.setattr(chunked, "_kernel_view", lambda y: kept.append(real(y) is y) or real(y))

    def run(strided, variant):
        xx = x.clone().requires_grad_()
        q, k, v = (y.view(b, t, h, d).transpose(1, 2) for y in xx.split(h * d, -1))
        if not strided:
            q, k, v = (y.contiguous() for y in (q, k, v))
        out = lssar.attention(q, k, v, is_causal=True, variant=variant, impl="cpu")
        (out.transpose(1, 2).reshape(b, t, h * d) @ proj).square().sum().backward()
        return out.detach(), xx.grad

    for variant in ("lssa", "lssar"):
        kept.clear()
        strided = run(True, variant)
        assert len(kept) == 7 and all(kept)  # q, k, v forward; grad, q, k, v backward
        for a, w in zip(strided, run(False, variant)):
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-6 * w.abs().max().item())
    y = x[..., : h * d].view(b, t, h, d).transpose(1, 2)
    assert real(y) is y
    assert real(y.transpose(2, 3)).is_contiguous()  # columns of stride > 1: copied
    assert real(x.as_strided((b, h, t, d), (0, 0, 1, 1))).is_contiguous()  # overlapping rows


@pytest.mark.parametrize("isa", [*cpu_kernel.runnable_isas(), "none"])
@pytest.mark.parametrize("d", [7, 32, 100])
def test_fused_qk_norm_matches_unit(monkeypatch, isa, d):
    """impl="cpu"'s QK-norm on the kernel gives common.unit's values and gradients on every row
    kind: random, scaled by 1e-30 and 1e30, zero (zeros, zero gradient), holding a NaN or an
    infinity (unit's values, NaN gradients); on a transposed view, with the row tails of 8 and
    16 lanes (d = 7, 100), and on bf16 input (upcast first, as unit does); isa "none": the ops'
    torch arithmetic where the kernel cannot be built (what a compiled call runs there)."""
    from lssar.ops.common import unit
    from lssar.ops.cpu.unit import unit_cpu, unit_cpu_op

    mod = None if isa == "none" else cpu_kernel.load(isa=isa)
    monkeypatch.setattr(cpu_kernel, "_loaded", {"mod": mod})
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, 3, d, generator=g).transpose(1, 2)  # (2, 3, 9, d), not contiguous
    x[0, 0, 1] *= 1e-30
    x[0, 0, 2] *= 1e30
    x[0, 1, 3] = 0.0
    x[1, 0, 4, 0] = float("nan")
    x[1, 2, 5, d - 1] = float("inf")
    dy = torch.randn(x.shape, generator=g)

    def run(f, x):
        xx = x.clone().requires_grad_()
        direct = f is unit_cpu and isa == "none" and x.dtype == torch.float32
        y = unit_cpu_op(xx)[0] if direct else f(xx)
        return y.detach(), torch.autograd.grad(y, xx, dy)[0]

    def close(a, b):  # per row: the same NaNs, finite entries within 2e-6 of the row's largest
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a.isnan(), b.isnan())
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        scale = b.abs().amax(-1, keepdim=True)
        assert ((a - b).abs() <= 2e-6 * scale).all()

    (y, dx), (y0, dx0) = run(unit_cpu, x), run(unit, x)
    close(y, y0)
    close(dx, dx0)
    assert (y[0, 1, 3] == 0).all() and (dx[0, 1, 3] == 0).all()
    assert dx[1, 0, 4].isnan().all() and dx[1, 2, 5].isnan().all()
    assert (y[0, 0, :3].norm(dim=-1) - 1).abs().max() < 1e-6
    xb = x.nan_to_num(0.0, 0.0, 0.0).bfloat16()
    close(*(run(f, xb)[0] for f in (unit_cpu, unit)))


# The build cache: a killed or hung build never blocks a later call, and environments do not
# share (so rebuild) one entry. Real builds run in subprocesses with their own
# TORCH_EXTENSIONS_DIR: the shared cache other processes load from is never touched.
REPO = Path(__file__).resolve().parents[2]


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "PYTHONPATH": str(REPO), **extra}
    env.pop(cpu_kernel.DISABLE_ENV, None)
    return env


# the build fails at once (no compiler to wait for) after the lock has been taken
FAILING_BUILD = """
import warnings, torch, lssar
from lssar.ops.cpu import build as cpu_kernel
def no_compiler(*args, **kwargs):
    raise RuntimeError("no compiler on this machine")
cpu_kernel._compile = no_compiler
q = torch.randn(1, 2, 150, 16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = lssar.attention(q, q, q, is_causal=True, variant="lssar", impl="cpu")
    again = lssar.attention(q, q, q, is_causal=True, variant="lssar", impl="cpu")
eager = lssar.attention(q, q, q, is_causal=True, variant="lssar", impl="chunked")
print(len([w for w in caught if "could not be built" in str(w.message)]), cpu_kernel.kernel(),
      torch.equal(out, eager) and torch.equal(again, eager))
"""


def test_a_build_killed_mid_way_does_not_block_the_next_call(tmp_path):
    """The real thing: kill -9 a build while torch's compile holds its lock file, then call
    impl='cpu' in a new process. It returns (here on the fallback: its build is made to fail at
    once) instead of waiting forever, and the killed build's directory is cleaned up."""
    root = tmp_path / "ext"
    build = subprocess.Popen(
        [sys.executable, "-m", "lssar.ops.cpu_kernel"],
        env=_env(root),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: ninja and the compiler die with it
    )
    try:
        for _ in range(600):  # until torch's build holds its lock in our build directory
            if any(root.glob(".lssar_cpu_kernel_*.build-*/lock")) or build.poll() is not None:
                break
            time.sleep(0.2)
        assert build.poll() is None, "the build ended before it could be killed"
        assert any(root.glob(".lssar_cpu_kernel_*.build-*/lock"))
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    (lock,) = root.glob("*.lock")  # the OS lock died with the process; its file stays
    done = subprocess.run(
        [sys.executable, "-c", FAILING_BUILD],
        env=_env(root),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard only: the call returns in seconds
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "None", "True"], done.stdout + done.stderr
    assert "waiting for process" not in done.stderr
    assert not list(root.glob(".lssar_cpu_kernel_*.build-*"))  # the killed build's leftovers


def test_a_held_lock_is_waited_for_with_a_message_then_falls_back(monkeypatch, tmp_path, capsys):
    """A live process holding the lock (a build that hangs): the call says what it waits for,
    gives up after $LSSAR_CPU_KERNEL_WAIT seconds and runs the eager path, with one warning."""
    import fcntl  # POSIX, as the kernel's build lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv(cpu_kernel.WAIT_ENV, "0.5")
    monkeypatch.setattr(cpu_kernel, "_loaded", {})

    def no_build(*args, **kwargs):
        raise AssertionError("built while another process holds the lock")

    monkeypatch.setattr(cpu_kernel, "_compile", no_build)
    q, k, v = _qkv(seed=2)
    expected = _run("chunked", q, k, v, variant="lssar", is_causal=True)
    lock = tmp_path / f"{cpu_kernel.entry_name()}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: conflicts with this process too
        os.write(fd, b"4242\n")
        with pytest.warns(RuntimeWarning, match="process 4242 has held the build lock") as caught:
            got = _run("cpu", q, k, v, variant="lssar", is_causal=True)
            _run("cpu", q, k, v, variant="lssar", is_causal=True)
    finally:
        os.close(fd)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert "waiting for process 4242 to finish building" in capsys.readouterr().err
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_bad_wait_setting_is_a_value_error(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv(cpu_kernel.WAIT_ENV, "forever")
    with pytest.raises(ValueError, match="LSSAR_CPU_KERNEL_WAIT='forever' must be a number"):
        cpu_kernel.kernel()


def test_each_environment_has_its_own_entry(monkeypatch, tmp_path):
    """What the library depends on names its entry; the checkout path does not."""
    base = cpu_kernel.entry_name()
    moved = tmp_path / "another-checkout" / cpu_kernel.SOURCE.name
    moved.parent.mkdir()
    shutil.copyfile(cpu_kernel.SOURCE, moved)
    monkeypatch.setattr(cpu_kernel, "SOURCE", moved)
    assert cpu_kernel.entry_name() == base  # the build compiles a copy: the path is no input
    changes = {
        "flags": lambda m: m.setattr(cpu_kernel, "_flags", lambda isa=None: ["-O2"]),
        "torch version": lambda m: m.setattr(torch, "__version__", "0.0.0"),
        "venv (torch headers)": lambda m: m.setattr(torch, "__file__", "/venv2/torch/__init__.py"),
        "python headers": lambda m: m.setattr(
            cpu_kernel.sysconfig, "get_paths", lambda: {"include": "/py2/include"}
        ),
        "python abi": lambda m: m.setattr(
            cpu_kernel.sysconfig, "get_config_var", lambda name: ".cpython-399-x.so"
        ),
        "compiler": lambda m: m.setenv("CXX", sys.executable),  # any other executable
        "source edit": lambda m: moved.write_text(moved.read_text() + "\n// edited\n"),
    }
    names = {base}
    for what, change in changes.items():
        with monkeypatch.context() as m:
            change(m)
            name = cpu_kernel.entry_name()
        assert name not in names, what
        names.add(name)


def test_another_checkout_loads_the_cached_build(monkeypatch, tmp_path):
    """A complete entry is loaded as it is, from any checkout: no lock, no rebuild (torch's
    own cache, keyed without the source path, rebuilt it for each checkout)."""
    assert cpu_kernel.kernel() is not None, "make setup builds the kernel on this machine"
    entry = tmp_path / cpu_kernel.entry_name()
    shutil.copytree(cpu_kernel.entry_dir(), entry)
    lib = entry / f"{entry.name}{cpu_kernel.LIB_SUFFIX}"
    before = lib.stat()
    moved = tmp_path / "another-checkout" / cpu_kernel.SOURCE.name
    moved.parent.mkdir()
    shutil.copyfile(cpu_kernel.SOURCE, moved)
    monkeypatch.setattr(cpu_kernel, "SOURCE", moved)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a complete entry")

    monkeypatch.setattr(cpu_kernel, "_compile", no_build)
    mod = cpu_kernel.load()
    assert mod.__name__ == entry.name and hasattr(mod, "forward")
    assert (lib.stat().st_mtime_ns, lib.stat().st_ino) == (before.st_mtime_ns, before.st_ino)


@pytest.mark.slow
def test_two_checkouts_build_once(tmp_path):
    """Two copies of the package at different paths, one cache: the second loads the first's
    build (a real compile, about a minute)."""
    root = tmp_path / "ext"
    libs = []
    for checkout in ("a", "b"):
        shutil.copytree(REPO / "lssar", tmp_path / checkout / "lssar")
        done = subprocess.run(
            [sys.executable, "-m", "lssar.ops.cpu_kernel"],
            env={**_env(root), "PYTHONPATH": str(tmp_path / checkout)},
            cwd=tmp_path / checkout,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0 and "ready" in done.stdout, done.stderr
        assert ("building the fused CPU kernel" in done.stderr) == (checkout == "a")
        (lib,) = root.glob(f"lssar_cpu_kernel_*/lssar_cpu_kernel_*{cpu_kernel.LIB_SUFFIX}")
        libs.append((lib, lib.stat().st_mtime_ns, lib.stat().st_ino))
    assert libs[0] == libs[1]
