"""The GPT's KV cache: appending in place equals concatenation, generate() equals recomputing the
whole sequence with one forward per token, each key's norm computed once and handed to the decode
entry, a one-row causal step builds no mask. The op-level decode steps are in
tests/ops/test_decode.py."""

from __future__ import annotations

import pytest
import torch

import lssar
from lssar.model import GPT, GPTConfig, KVCache
from tests.accuracy import err

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- the GPT's cache


def test_kv_cache_appends_in_place_and_equals_concatenation():
    cache = KVCache(2)
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 3, t, 4, generator=g) for t in (5, 1, 1, 3, 1)]
    seen = []
    for x in parts:
        k, v = cache.update(1, x, -x)
        cache.update(0, x, x)
        seen.append(k)
        assert torch.equal(k, torch.cat(parts[: len(seen)], 2)) and torch.equal(v, -k)
    assert cache.length == 11 and cache.k[1].shape == (2, 3, 11, 4)
    # views returned earlier still show their own prefix after later appends and regrowth
    for i, k in enumerate(seen):
        assert torch.equal(k, torch.cat(parts[: i + 1], 2))
    # the buffer grows by doubling: 5 -> 10 -> 20 slots, not one reallocation per token
    assert cache._k[1].shape[2] == 20


def test_kv_cache_under_autograd_concatenates():
    """An in-place append would invalidate the cached views a backward pass saved."""
    cache = KVCache(1)
    x = torch.randn(1, 1, 3, 2, requires_grad=True)
    y = torch.randn(1, 1, 1, 2, requires_grad=True)
    k1, _ = cache.update(0, x, x)
    loss = (k1 * 2).sum()
    k2, _ = cache.update(0, y, y)
    (loss + k2.pow(2).sum()).backward()
    assert torch.equal(x.grad, 2 + 2 * x.detach()) and torch.equal(y.grad, 2 * y.detach())


def _gpt(attn: str, impl: str, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=64, attn=attn, attn_impl=impl, **kw)
    return GPT(cfg).eval()


@pytest.mark.parametrize(
    "attn,impl,kw",
    [
        ("softmax", "auto", {}),
        ("softmax", "sdpa", {"n_kv_head": 2}),
        ("lssar", "auto", {}),  # prefill on the fused kernel, decode steps on the reference
        ("lssar", "cpu", {"n_kv_head": 2}),
        ("lssar", "chunked", {}),
    ],
)
def test_generate_equals_recomputing_the_full_sequence(attn, impl, kw):
    """float32: the tokens of generate() are the argmax of the full forward over the generated
    sequence, and the cached step logits equal that forward's."""
    model = _gpt(attn, impl, **kw)
    prompt = torch.randint(0, 64, (2, 130), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, 8, temperature=0.0)
    with torch.no_grad():
        full, _ = model(out)
        assert torch.equal(out[:, 130:], full[:, 129:-1].argmax(-1))
        cache = KVCache(2)
        steps = [model(out[:, :130], cache=cache)[0][:, -1]]
        for t in range(130, out.shape[1] - 1):
            steps.append(model(out[:, t : t + 1], cache=cache)[0][:, -1])
    cached = torch.stack(steps, 1)  # (B, 8, V): the predictions after tokens 129 .. 136
    want = full[:, 129:-1]
    assert torch.allclose(cached, want, atol=2e-5, rtol=1e-4), err(cached, want)


def test_generate_runs_one_forward_per_sampled_token():
    """The prompt's forward gives the first token, one forward per further token: the last
    token's successor is never computed."""
    model = _gpt("lssar", "auto")
    calls = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(args[0].shape[1]), with_kwargs=True
    )
    out = model.generate(torch.randint(0, 64, (1, 5)), 4, temperature=0.0)
    assert out.shape == (1, 9) and calls == [5, 1, 1, 1]
    calls.clear()
    assert model.generate(torch.randint(0, 64, (1, 5)), 0).shape == (1, 5) and calls == [5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unit_without_a_graph_is_the_same_bits_in_place(dtype):
    """A decode step on the reference or chunked normalises the whole key cache: without
    autograd ``common.unit`` works in place on its one buffer, and must give exactly what the
    differentiable form gives (zero, tiny, huge and NaN rows included)."""
    from lssar.ops.common import unit

    x = torch.randn(2, 3, 40, 16, generator=torch.Generator().manual_seed(0))
    x[0, 0, 3], x[0, 1, 4], x[1, 2, 5], x[1, 1, 6] = 0.0, float("nan"), 1e30, 1e-30
    x = x.to(dtype)
    before = x.clone()
    with torch.no_grad():
        fast = unit(x)
    slow = unit(x.clone().requires_grad_()).detach()
    assert torch.equal(fast.nan_to_num(7.0), slow.nan_to_num(7.0))
    assert torch.equal(x.nan_to_num(7.0), before.nan_to_num(7.0))  # the input is untouched


def test_a_one_row_causal_step_builds_no_mask(monkeypatch):
    """T_q = 1 bottom-right causal sees every key: the router drops is_causal, so no
    implementation builds a mask for it, and the result is unchanged."""
    from lssar.ops import sdpa

    q, k, v = (torch.randn(1, 2, n, 8) for n in (1, 50, 50))
    seen = []
    real = sdpa.F.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(a[3] if len(a) > 3 else kw.get("attn_mask"))
        return real(*a, **kw)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    out = lssar.attention(q, k, v, is_causal=True, variant="softmax", impl="sdpa")
    assert seen == [None]
    ref = lssar.attention(q, k, v, is_causal=True, variant="softmax", impl="reference")
    torch.testing.assert_close(out, ref)


# ------------------------------------------------------------- the keys' norms, kept by a cache


def test_kv_cache_computes_each_key_norm_once(monkeypatch):
    """KVCache.key_norms: 1 / ||k_j|| of every cached key (0 for a zero or non-finite key), each
    computed once, across appends and regrowth of the buffers."""
    import lssar.model as model_mod
    from lssar.ops.decode import key_inverse_norms

    computed = []
    real = model_mod.key_inverse_norms
    monkeypatch.setattr(
        model_mod, "key_inverse_norms", lambda k: computed.append(k.shape[2]) or real(k)
    )
    cache = KVCache(1)
    assert cache.key_norms(0) is None
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(2, 3, t, 8, generator=g) for t in (6, 1, 1, 9, 1)]
    parts[1][0, 1] = 0.0  # a zero key
    parts[3][1, 2, 4] = float("nan")  # a non-finite key
    for i, x in enumerate(parts):
        cache.update(0, x, x)
        got = cache.key_norms(0)
        again = cache.key_norms(0)  # nothing new to compute
        keys = torch.cat(parts[: i + 1], 2)
        torch.testing.assert_close(got, key_inverse_norms(keys), rtol=3e-7, atol=0)
        assert torch.equal(again, got) and got.dtype == torch.float32
    assert sum(computed) == 18  # every key once
    assert got[0, 1, 6] == 0 and got[1, 2, 12] == 0


def test_generate_hands_the_cached_norms_to_the_decode_entry(monkeypatch):
    """The GPT's decode steps pass KVCache's norms: the entry gets them at every step and the
    tokens are those of the same model whose steps normalise the keys themselves."""
    from lssar.ops.cpu.build import kernel

    mod = kernel()
    given, real = [], mod.decode
    monkeypatch.setattr(mod, "decode", lambda *a: given.append(a[3] is not None) or real(*a))
    model = _gpt("lssar", "cpu", n_kv_head=2)
    prompt = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(5))
    out = model.generate(prompt, 6, temperature=0.0)
    assert given == [True] * 2 * 5  # 2 layers x 5 decode steps
    monkeypatch.setattr(KVCache, "key_norms", lambda self, layer: None)
    given.clear()
    assert torch.equal(model.generate(prompt, 6, temperature=0.0), out)
    assert given == [False] * 2 * 5
