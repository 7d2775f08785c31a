"""The op layer's public face: ``lssar.ops.__all__``, the old import paths that still work,
``registry.check`` (a spec validated without tensors) and the named fake implementations."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import lssar.ops
from lssar.ops import registry
from lssar.ops.variants import VARIANTS

OPS = Path(lssar.ops.__file__).parent
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_every_public_name_imports_and_is_the_documented_one():
    names = lssar.ops.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert getattr(lssar.ops, name) is not None, name
    star: dict = {}
    exec("from lssar.ops import *", star)
    assert set(star) - {"__builtins__"} == set(names)
    # the package docstring names every public name (and no other bare :role:`name`)
    documented = set(re.findall(r":(?:func|data|class):`([A-Za-z]\w*)`", lssar.ops.__doc__))
    assert documented == set(names)
    # each name is its defining module's object, not a copy
    assert lssar.ops.attention is importlib.import_module("lssar.ops.api").attention
    assert lssar.ops.IMPLS is registry.IMPLS and lssar.ops.check is registry.check
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lssar.ops.nope  # noqa: B018


def test_importing_the_face_loads_no_backend_and_no_torch():
    code = (
        "import sys, lssar.ops\n"
        "assert 'torch' not in sys.modules\n"
        "from lssar.ops import attention, check, get_variant\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('lssar.ops.'))\n"
        "assert loaded == ['lssar.ops.api', 'lssar.ops.common', 'lssar.ops.registry', "
        "'lssar.ops.spans', 'lssar.ops.variants'], loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_old_import_paths_still_work():
    from lssar.ops import api, chunked, cpu_kernel
    from lssar.ops.cpu import build
    from lssar.ops.registry import attention

    assert attention is api.attention
    assert cpu_kernel is build  # one module: patching either name patches both
    assert build.SOURCE.is_file() and build.SOURCE.parent == OPS / "cpu"
    assert chunked.is_decode_step is lssar.ops.is_decode_step
    assert lssar.attention is api.attention and lssar.variants is registry.variants


def test_the_old_cpu_kernel_command_still_runs():
    done = subprocess.run(
        [sys.executable, "-m", "lssar.ops.cpu_kernel"],
        env={**os.environ, "LSSAR_NO_CPU_KERNEL": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "lssar: fused CPU kernel unavailable" in done.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_devtools_are_apart_from_the_kernels():
    """The Triton kernels import no developer tool; the tools' old names are the same modules
    and their old commands still run."""
    for path in sorted((OPS / "triton").glob("*.py")):
        if path.stem in ("compile_check", "cost"):  # the old names, kept as aliases
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert "devtools" not in node.module, path
                assert not {a.name for a in node.names} & {"compile_check", "cost", "sass"}, path
    code = (
        "import sys, lssar.ops.triton.host\n"
        "assert not [m for m in sys.modules if 'devtools' in m], 'the kernels pulled them in'\n"
        "from lssar.ops.triton import compile_check, cost\n"
        "from lssar.ops.triton.devtools import compile_check as cc, cost as c\n"
        "assert compile_check is cc and cost is c\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    for tool in ("compile_check", "cost"):
        done = subprocess.run(
            [sys.executable, "-m", f"lssar.ops.triton.{tool}", "--help"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"lssar.ops.triton.devtools.{tool}" in done.stdout


# ---------------------------------------------------------------------------- registry.check


class _Record(TorchFunctionMode):
    """Records every torch function called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _RecordDispatch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "variant,impl,options",
    [
        ("lssar", "auto", {}),
        ("lssar", "chunked", {"p": 3.0}),
        ("lssar", "cpu", {}),
        ("lssa", "reference", {}),
        ("softmax", "sdpa", {}),
        ("softmax-qknorm-const", "auto", {"n": 512}),
    ],
)
def test_check_accepts_a_valid_spec_without_any_tensor_op(variant, impl, options):
    fn, dispatch = _Record(), _RecordDispatch()
    with fn, dispatch:
        got = registry.check(variant, impl, options)
    assert fn.calls == [] and dispatch.calls == []
    assert got.variant is VARIANTS[variant] and got.impl == impl
    assert got.options == {**VARIANTS[variant].options, **options}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"variant": "lssarr"}, r"unknown attention variant 'lssarr'; valid variants: .*lssar"),
        ({"variant": "lssar", "options": {"q": 1}}, r"variant 'lssar' takes no option 'q'"),
        ({"variant": "lssar", "options": {"p": -1.0}}, r"p must be a float"),
        ({"variant": "lssar", "impl": "cuda"}, r"unknown impl 'cuda'.*valid impls: auto, "),
        ({"variant": "lssar", "impl": "sdpa"}, r"impl 'sdpa' does not run variant 'lssar'"),
        ({"variant": "lssar", "impl": "chunked", "dropout_p": 0.1}, r"has no dropout"),
        ({"variant": "lssar", "impl": "chunked", "alibi": True}, r"alibi_slopes biases"),
        ({"variant": "softmax", "impl": "reference", "impl_options": {"block": 4}}, r"no option"),
        ({"variant": "lssar", "impl_options": {"block": 4}}, r"pass impl= explicitly"),
        ({"variant": "lssar", "impl": "chunked", "impl_options": {"block": -1}}, r"int >= 0"),
    ],
)
def test_check_refuses_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        registry.check(**kwargs)


def _said(call, *args, **kwargs) -> str | None:
    """The ValueError's message of ``call(*args, **kwargs)``, or None where it accepts."""
    try:
        call(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def test_check_says_what_resolve_says_on_every_variant_and_impl():
    """check is resolve's validation: on a float32 probe both accept or both refuse, with the
    same message, for every variant x impl x dropout (the probe only routes the call)."""
    probe = torch.zeros(1, 1, 1, 2)  # (B, H, T, D)
    for name, v in VARIANTS.items():
        for impl in ("auto", *registry.BACKENDS, "nope"):
            for dropout_p in (0.0, 0.1):
                for opts in ({}, {"p": 2.0} if "p" in v.options else {"zz": 1}):
                    checked = _said(registry.check, name, impl, opts, dropout_p=dropout_p)
                    resolved = _said(registry.resolve, name, impl, probe, probe, dropout_p, opts)
                    assert checked == resolved, (name, impl, dropout_p, opts)


def test_spec_construction_runs_no_tensor_op():
    from lssar.spec import AttentionSpec, check_runs

    fn, dispatch = _Record(), _RecordDispatch()
    with fn, dispatch:
        spec = AttentionSpec("lssar", {"p": 3.0}, "chunked")
        check_runs(spec)
    assert fn.calls == [] and dispatch.calls == []
    with pytest.raises(ValueError, match="impl 'sdpa' does not run variant 'lssar'"):
        AttentionSpec("lssar", {}, "sdpa")


# ----------------------------------------------------------------------------- named fakes


def _fakes() -> list[tuple[str, str]]:
    """(module path, function name) of every ``@op.register_fake`` function under lssar/ops."""
    found = []
    for path in sorted(OPS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if isinstance(dec, ast.Attribute) and dec.attr == "register_fake":
                        found.append((path.relative_to(OPS).as_posix(), node.name))
    return found


def test_every_fake_implementation_has_its_own_name():
    fakes = _fakes()
    assert len(fakes) >= 6, fakes  # chunked (2), decode (1), triton host (3)
    names = [name for _, name in fakes]
    assert "_" not in names, fakes
    assert len(set(names)) == len(names), fakes
    assert all(name.endswith("_fake") for name in names), fakes


def test_the_fakes_are_the_ones_torch_runs():
    """The named functions are registered: a fake-tensor call of each CPU custom op returns
    the shapes they give."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lssar.ops import chunked, decode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 3, 8), torch.empty(2, 2, 5, 8), torch.empty(2, 2, 5, 6)
        out = decode.softplus_decode_op(q, k, v, None, False, 1.0, False, True, None)
        assert out.shape == (2, 4, 3, 6)
        k4, v4 = torch.empty(2, 4, 5, 8), torch.empty(2, 4, 5, 6)
        out = chunked.softplus_attention_op(q, k4, v4, None, True, 1.0, False, None, 0)
        assert out.shape == (2, 4, 3, 6)
        g = torch.empty(2, 4, 3, 6)
        grads = chunked.softplus_attention_backward_op(
            g, q, k4, v4, None, True, 1.0, False, None, 0
        )
        assert [t.shape for t in grads] == [q.shape, k4.shape, v4.shape]
