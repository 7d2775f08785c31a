"""The fused C++ CPU kernel (impl="cpu"): it really runs, it is cached, and without a compiler
the same call runs chunked's eager path after one warning. Its accuracy is held to the float64
reference by the registry-generated grids in test_attention.py and test_robustness.py."""

from __future__ import annotations

import warnings

import pytest
import torch

import lssar
from lssar.ops import chunked, cpu_kernel, registry


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
    assert first.__name__ == cpu_kernel._name(cpu_kernel._flags())  # keyed by source + flags


def test_no_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    """A machine that cannot build the kernel: the real build fails, one warning, same results."""
    q, k, v = _qkv(seed=1)
    expected = _run("chunked", q, k, v, variant="lssar", is_causal=True)
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_kernel, "_name", lambda flags: "lssar_cpu_kernel_nocompiler_test")
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


def test_isa_switch_picks_the_build_and_rejects_what_the_machine_cannot_run(monkeypatch):
    for isa in cpu_kernel.runnable_isas():
        monkeypatch.setattr(cpu_kernel, "_loaded", {})
        monkeypatch.setenv(cpu_kernel.ISA_ENV, isa)
        assert cpu_kernel.kernel().__name__ == cpu_kernel._name(cpu_kernel._flags(isa))
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
    q = unit(torch.randn(b * h, tq, d, generator=g))
    k = unit(torch.randn(b * h, tk, d, generator=g))
    v = torch.randn(b * h, tk, d, generator=g)
    mask = (torch.rand(b, 1, tq, tk, generator=g) > 0.3).expand(b, h, tq, tk)
    rule = (-1.0 if p is None else p, float(REWEIGHT_MIN_KEYS), uniform_tolerance(torch.float32))
    args = (mask, h, True, 4.16, True, *rule, 16)
    whole, uf1 = mod.forward(q, k, v, *args, tk)
    tiled, uf2 = mod.forward(q, k, v, *args, 16)
    assert not uf1 and not uf2
    assert torch.allclose(tiled, whole, rtol=1e-5, atol=1e-6)
