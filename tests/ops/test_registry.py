"""The registry and the public entry: the variants listing, bad-input errors, one input check per
call, the float64 fallback, implementation options reaching and validated, entries matching their
functions, no backend importing the registry."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lssar
from lssar.ops import registry
from lssar.ops.variants import VARIANTS
from tests.ops.attention_inputs import _inputs


def test_variants_listing():
    listing = {v["name"]: v for v in lssar.variants()}
    assert set(listing) == set(VARIANTS)
    assert listing["lssar"]["options"] == {"p": 15.0, "scale_dim": None}
    assert listing["lssar-p3"]["options"] == {"p": 3.0, "scale_dim": None}
    assert "chunked" in listing["lssar"]["impls"] and "sdpa" in listing["softmax"]["impls"]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda q, k, v: lssar.attention(q[0], k, v), "query must have 4 dims"),
        (lambda q, k, v: lssar.attention(q, k[..., :4], v), "head dims differ"),
        (lambda q, k, v: lssar.attention(q, k[:, :3], v[:, :3], enable_gqa=True), "divisible"),
        (lambda q, k, v: lssar.attention(q, k[:, :2], v[:, :2]), "enable_gqa=True"),
        (lambda q, k, v: lssar.attention(q, k, v, torch.ones(3, 3)), "boolean"),
        (lambda q, k, v: lssar.attention(q, k, v, torch.ones(5, 2, dtype=torch.bool)), "broadcast"),
        (lambda q, k, v: lssar.attention(q, k, v, p=0.0), "p must be"),
        (lambda q, k, v: lssar.attention(q, k, v, p=float("nan")), "p must be"),
        (lambda q, k, v: lssar.attention(q, k, v, variant="lssa", q=2), "takes no option 'q'"),
        (lambda q, k, v: lssar.attention(q, k, v, variant="relu", p=3.0), "takes no option 'p'"),
        (lambda q, k, v: lssar.attention(q, k, v, variant="nope"), "valid variants: softmax"),
        (lambda q, k, v: lssar.attention(q, k, v, impl="cuda"), "valid impls"),
        (lambda q, k, v: lssar.attention(q, k, v, variant="relu", impl="chunked"), "use one of"),
        (lambda q, k, v: lssar.attention(q, k, v, variant="lssa", scale=0.1), "pass scale=None"),
        (lambda q, k, v: lssar.attention(q, k, v, dropout_p=1.5), "dropout_p"),
        (lambda q, k, v: lssar.attention(q.int(), k, v), "float16"),
    ],
)
def test_bad_input_errors(call, match):
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


def _count_check_inputs(monkeypatch) -> list[int]:
    """Count calls of check_inputs wherever an lssar.ops module holds a reference to it."""
    from lssar.ops import common

    calls = [0]
    original = common.check_inputs

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("lssar") and getattr(module, "check_inputs", None) is original:
            monkeypatch.setattr(module, "check_inputs", counting)
    return calls


@pytest.mark.parametrize("impl", list(registry.IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_check_inputs_runs_once_per_call(impl, dtype, monkeypatch):
    """Arguments are checked once, in lssar.attention; the float64 fallback does not re-check."""
    name = "lssar" if impl in registry.supporting("lssar") else "softmax"
    assert callable(registry.BACKENDS[impl].fn)  # imported first, so its module is patched too
    calls = _count_check_inputs(monkeypatch)
    q, k, v = (t.detach() for t in _inputs((1, 2, 2, 6, 6, 16), dtype))  # flex: CPU forward only
    lssar.attention(q, k, v, is_causal=True, variant=name, impl=impl)
    assert calls[0] == 1


def test_float64_fallback_is_the_chunked_result():
    q, k, v = _inputs((1, 2, 2, 9, 9, 16), torch.float64)
    chunked = lssar.attention(q, k, v, is_causal=True, impl="chunked")
    for impl in set(registry.IMPLS) & {"triton", "flex"}:
        assert registry.resolve("lssar", impl, q, k, 0.0, {})[1] == "chunked"
        torch.testing.assert_close(
            lssar.attention(q, k, v, is_causal=True, impl=impl), chunked, rtol=0, atol=0
        )
        with pytest.raises(ValueError, match=f"impl={impl!r} has no dropout"):
            lssar.attention(q, k, v, dropout_p=0.1, impl=impl)


def test_impl_options_reach_the_implementation(monkeypatch):
    q, k, v = _inputs((1, 2, 2, 40, 40, 16), torch.float32)
    one_block = lssar.attention(q, k, v, is_causal=True, impl="chunked")
    blocks = lssar.attention(q, k, v, is_causal=True, impl="chunked", impl_options={"block": 16})
    torch.testing.assert_close(blocks, one_block)
    calls = []
    original = registry.BACKENDS["chunked"].fn

    def spy(*args, **kwargs):
        calls.append(kwargs.get("block"))
        return original(*args, **kwargs)

    entry = dataclasses.replace(registry.BACKENDS["chunked"], load=lambda: spy)
    monkeypatch.setitem(registry.BACKENDS, "chunked", entry)
    lssar.attention(q, k, v, impl="chunked", impl_options={"block": 16})
    lssar.attention(q, k, v, impl="chunked")
    assert calls == [16, None]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(impl="chunked", impl_options={"blocks": 2}), "no option 'blocks'.*block=0"),
        (dict(impl="reference", impl_options={"precise": False}), "options are: none"),
        (dict(impl="chunked", impl_options={"block": -1}), "must be an int >= 0"),
        (dict(impl="chunked", impl_options={"block": True}), "must be an int >= 0"),
        (dict(impl="auto", impl_options={"block": 2}), "pass impl= explicitly"),
        (dict(impl="chunked", impl_options=[("block", 2)]), "must be a dict"),
    ],
)
def test_impl_options_are_validated(kw, match):
    q, k, v = _inputs((1, 2, 2, 6, 6, 8), torch.float32)
    with pytest.raises(ValueError, match=match):
        lssar.attention(q, k, v, variant="lssar", **kw)


def test_registry_entries_match_their_functions():
    """Each available entry's options are its function's keyword options, with their defaults;
    an entry takes ``alibi_slopes`` and ``spans`` exactly when it says so; every entry's fallback
    exists and runs what it falls back from."""
    for name, entry in registry.IMPLS.items():
        params = inspect.signature(entry.fn).parameters
        extra = {
            n: p.default
            for n, p in params.items()
            if p.kind is p.KEYWORD_ONLY
            and n not in ("variant", "options", "alibi_slopes", "spans", "key_norms")
        }
        assert extra == dict(entry.options), name
        assert ("alibi_slopes" in params) == entry.alibi, name
        assert ("spans" in params) == entry.spans, name
        assert ("key_norms" in params) == entry.key_norms, name
    for name, entry in registry.BACKENDS.items():
        if entry.float64 is not None:
            target = registry.BACKENDS[entry.float64]
            assert target.float64 is None and target.available
            for v in VARIANTS.values():
                assert not entry.supports(v, v.options) or target.supports(v, v.options), name
    listing = {i["name"]: i for i in registry.implementations()}
    assert list(listing) == list(registry.BACKENDS)
    assert [n for n, i in listing.items() if i["available"]] == list(registry.IMPLS)
    assert listing["triton"]["options"] == {"precise": True, "deterministic": False}


def test_no_backend_imports_the_registry():
    """The registry owns its backends: no backend module of lssar.ops imports it (or lssar,
    which re-exports it; only the public face does: api.py, __init__.py); importing lssar
    imports neither it nor torch (the lssar command sets OpenMP's environment first), and
    reaching lssar.attention loads the registry but no backend (they load on first use)."""
    ops = Path(registry.__file__).parent
    for path in sorted(ops.rglob("*.py")):
        if path.relative_to(ops).as_posix() in ("registry.py", "api.py", "__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert name not in ("lssar", "lssar.ops.registry"), (path, name)
    code = (
        "import sys, lssar\n"
        "assert 'torch' not in sys.modules and 'lssar.ops' not in sys.modules\n"
        "lssar.attention\n"
        "loaded = [m for m in sys.modules if m.startswith('lssar.ops.')]\n"
        "assert sorted(loaded) == ['lssar.ops.api', 'lssar.ops.common', 'lssar.ops.registry', "
        "'lssar.ops.spans', 'lssar.ops.variants'], loaded\n"
        "assert 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
