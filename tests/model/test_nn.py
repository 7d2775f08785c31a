"""lssar.nn: the attention modules equal the functional call and the GPT's attention, decode with
a KV cache, compile, and shard with FSDP2."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn as tnn

import lssar
from lssar.model import GPT, GPTConfig, KVCache
from lssar.nn import Attention, CoreAttention
from lssar.positions import alibi_slopes, apply_rope, rope_cache

CORE_CASES = [
    ("lssar", {"p": 15.0}, "reference"),
    ("lssar", {"p": 3.0}, "chunked"),
    ("lssa", {}, "cpu"),
    ("softmax", {}, "sdpa"),
    ("softmax-qknorm-logn", {}, "auto"),
]


def _qkv(b=2, h=4, h_kv=2, t=23, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, h_kv, t, d, generator=g, requires_grad=True)
    v = torch.randn(b, h_kv, t, d, generator=g, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize(("variant", "options", "impl"), CORE_CASES)
def test_core_attention_is_the_functional_call(variant, options, impl):
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 1, 23, dtype=torch.bool)
    mask[1, ..., :4] = False  # left padding of the second row
    core = CoreAttention(variant, options, impl)
    for kw, call in (
        ({}, {}),
        ({"attn_mask": mask}, {}),
        ({"window": 5}, {"window": (4, 0)}),
        ({"window": 5, "sink_tokens": 2}, {"window": (4, 0), "sink_tokens": 2}),
    ):
        out = core(q, k, v, **kw)
        ref = lssar.attention(
            q,
            k,
            v,
            kw.get("attn_mask"),
            is_causal=True,
            enable_gqa=True,
            variant=variant,
            impl=impl,
            **call,
            **options,
        )
        assert torch.equal(out, ref), kw
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
        want = torch.autograd.grad(ref.square().sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), kw
    # packed documents along T (B = 1); the module's own window as its default
    docs = torch.tensor([0, 9, 23])
    q1, k1, v1 = (t[:1] for t in (q, k, v))
    ref = lssar.attention(
        q1, k1, v1, is_causal=True, enable_gqa=True, variant=variant, impl=impl,
        cu_seqlens=docs, **options,
    )  # fmt: skip
    assert torch.equal(core(q1, k1, v1, cu_seqlens=docs), ref)
    windowed = CoreAttention(variant, options, impl, window=5)
    assert torch.equal(windowed(q, k, v), core(q, k, v, window=5))
    assert torch.equal(windowed(q, k, v, window=None), core(q, k, v))


def test_core_attention_weights_dropout_and_learned_scale():
    q, k, v = _qkv(h_kv=4)
    core = CoreAttention("lssar", {"p": 15.0})
    w = core.weights(q, k, window=6)
    assert w.shape == (2, 4, 23, 23)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 23))
    assert w[..., 10, :5].abs().max() == 0  # outside the window
    torch.testing.assert_close(w @ v, core(q, k, v, window=6), atol=1e-5, rtol=1e-5)
    # a learned per-head scale: a parameter of the module, or passed in
    ssmax = CoreAttention("ssmax", num_heads=4)
    assert isinstance(ssmax.ssmax_s, tnn.Parameter) and ssmax.ssmax_s.shape == (4,)
    s = torch.full((4,), 0.9)
    ref = lssar.attention(q, k, v, is_causal=True, variant="ssmax", s=s)
    assert torch.equal(ssmax(q, k, v, s=s), ref)
    with pytest.raises(ValueError, match="learns one scale per head: pass num_heads"):
        CoreAttention("ssmax")
    with pytest.raises(ValueError, match="needs its learned per-head scale"):
        CoreAttention("ssmax", learned_scale=False)(q, k, v)
    with pytest.raises(ValueError, match=r"dropout=1\.5 must be a number in \[0, 1\)"):
        CoreAttention("lssar", dropout=1.5)
    with pytest.raises(ValueError, match="window=0 must be a whole number >= 1"):
        CoreAttention("lssar", window=0)
    with pytest.raises(ValueError, match="unknown attention variant"):
        CoreAttention("nope")
    drop = CoreAttention("lssar", impl="reference", dropout=0.5)
    assert torch.equal(drop.eval()(q, k, v), core(q, k, v))  # no dropout at evaluation
    assert not torch.equal(drop.train()(q, k, v), core(q, k, v))


def _by_hand(layer: Attention, x, positions, mask=None, **call):
    """The layer's math written out: projections, RoPE / ALiBi, lssar.attention, output."""
    b, t, c = x.shape
    h, kv, d = layer.n_head, layer.n_kv, layer.head_dim
    q, k, v = layer.qkv(x).split([h * d, kv * d, kv * d], dim=-1)
    q, k, v = (y.view(b, t, -1, d).transpose(1, 2) for y in (q, k, v))
    extra = {}
    if layer.pos == "rope":
        cos, sin = rope_cache(d, positions, layer.rope_base)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    elif layer.pos == "alibi":
        extra["alibi_slopes"] = alibi_slopes(h)
    spec = layer.core.spec
    y = lssar.attention(
        q, k, v, mask, is_causal=True, enable_gqa=h != kv, variant=spec.name, impl=spec.impl,
        **extra, **call, **spec.options,
    )  # fmt: skip
    return layer.proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize(
    ("variant", "pos", "kv"),
    [("lssar", "rope", 2), ("softmax", "alibi", 4), ("lssa", "nope", 1), ("softmax", "rope", 4)],
)
def test_attention_layer_is_its_math_written_out(variant, pos, kv):
    torch.manual_seed(0)
    layer = Attention(64, 4, kv, variant=variant, pos=pos, bias=True)
    x = torch.randn(2, 19, 64)
    mask = torch.ones(2, 1, 1, 19, dtype=torch.bool)
    mask[0, ..., :3] = False
    positions = torch.arange(19)
    assert torch.equal(layer(x), _by_hand(layer, x, positions))
    assert torch.equal(layer(x, mask), _by_hand(layer, x, positions, mask))
    win = _by_hand(layer, x, positions, window=(6, 0))
    assert torch.equal(layer(x, window=7), win)
    assert torch.equal(layer(x, positions=positions + 5), _by_hand(layer, x, positions + 5))


def test_attention_layer_is_the_gpt_attention():
    """A stand-alone layer with a GPT layer's weights gives what that layer gives inside the GPT
    (which computes RoPE once for every layer and passes it in)."""
    torch.manual_seed(1)
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, attn="lssar")
    gpt = GPT(cfg).eval()
    seen = {}
    gpt.blocks[1].attn.register_forward_hook(lambda m, a, out: seen.update(x=a[0], out=out))
    idx = torch.randint(0, 50, (2, 21))
    gpt(idx)
    layer = Attention(32, 4, 2, variant="lssar", layer_idx=1)
    layer.load_state_dict(gpt.blocks[1].attn.state_dict())
    assert type(gpt.blocks[1].attn) is Attention
    assert torch.equal(layer(seen["x"]), seen["out"])
    # switching the GPT's rule switches every layer's
    gpt.set_attention("lssar", {"p": 3.0})
    assert all(
        b.attn.core.spec == lssar.spec.AttentionSpec("lssar", {"p": 3.0}) for b in gpt.blocks
    )


def test_attention_layer_decodes_with_a_kv_cache():
    torch.manual_seed(2)
    layers = tnn.ModuleList(Attention(32, 4, 2, variant="lssar", layer_idx=i) for i in range(2))
    x = torch.randn(1, 17, 32)

    def run(x, cache=None):
        for layer in layers:
            x = x + layer(x, cache=cache)
        return x

    with torch.no_grad():
        whole = run(x)
        cache = KVCache(2)
        steps = [run(x[:, :9], cache)] + [run(x[:, i : i + 1], cache) for i in range(9, 17)]
    assert cache.past_length(0) == cache.past_length(1) == 17
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-5, rtol=1e-5)


def test_attention_layer_options_and_errors():
    x = torch.randn(2, 7, 32)
    layer = Attention(32, 4, variant="lssar", qk_norm=True)
    assert isinstance(layer.q_norm, tnn.RMSNorm) and layer(x).shape == (2, 7, 32)
    assert Attention(32, 4, variant="ssmax").ssmax_s.shape == (4,)
    assert Attention(32, 4, variant="softmax", causal=False).core.causal is False
    for kw, match in (
        (dict(hidden_size=30, num_heads=4), "must be divisible by num_heads"),
        (dict(hidden_size=32, num_heads=4, num_kv_heads=3), "divisible by num_kv_heads"),
        (dict(hidden_size=32, num_heads=4, num_kv_heads=0), "num_kv_heads=0 must be a whole"),
        (dict(hidden_size=24, num_heads=8), "must be even for RoPE"),
        (dict(hidden_size=32, num_heads=4, variant="lssar", pos="alibi"), "cannot take it"),
        (dict(hidden_size=32, num_heads=4, pos="learned"), "unknown pos 'learned'"),
        (dict(hidden_size=32, num_heads=4, impl="nope"), "unknown attn_impl 'nope'"),
    ):
        with pytest.raises(ValueError, match=match):
            Attention(**kw)


class _Tiny(tnn.Module):
    """A model of someone else's: embeddings, two blocks of lssar.nn.Attention + MLP, a head."""

    def __init__(self, variants: tuple[str, ...] = ("lssar", "lssar"), impl="auto") -> None:
        super().__init__()
        self.emb = tnn.Embedding(40, 32)
        self.blocks = tnn.ModuleList(
            tnn.ModuleDict(
                {
                    "norm": tnn.LayerNorm(32),
                    "attn": Attention(32, 4, 2, variant=variant, impl=impl, layer_idx=i),
                    "mlp": tnn.Sequential(tnn.Linear(32, 64), tnn.GELU(), tnn.Linear(64, 32)),
                }
            )
            for i, variant in enumerate(variants)
        )
        self.head = tnn.Linear(32, 40)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = h + b["attn"](b["norm"](h))
            h = h + b["mlp"](h)
        return self.head(h)


def test_torch_compile_a_model_built_from_it():
    """One graph (fullgraph=True) forward and backward, equal to eager (the memory-efficient
    impl, and a variant with a learned per-head scale)."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = _Tiny(("lssar", "ssmax"), impl="auto")
    idx = torch.randint(0, 40, (2, 24))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, ref = compiled(idx), model(idx)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    want = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


@pytest.mark.slow
def test_torch_compile_inductor():
    """The default backend (inductor: generated C++ on CPU) on a model built from it."""
    torch._dynamo.reset()
    torch.manual_seed(4)
    model = _Tiny(("lssar", "ssmax"))
    idx = torch.randint(0, 40, (2, 24))
    out = torch.compile(model)(idx)
    torch.testing.assert_close(out, model(idx), atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, world: int, port: int) -> None:
    """One rank: the model sharded with FSDP2 (fully_shard per block, then the root), a step
    of forward and backward, the full gradients gathered."""
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(5)
        model = _Tiny(("lssar", "ssmax"))
        plain = copy.deepcopy(model)
        for block in model.blocks:
            fully_shard(block["attn"])
        fully_shard(model)
        idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(rank))
        loss = model(idx).square().mean()
        loss.backward()
        ref = plain(idx).square().mean()
        ref.backward()
        assert torch.allclose(loss, ref, atol=1e-6), (loss, ref)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            grad = p.grad.full_tensor()  # averaged over the ranks, each with its own batch
            mean = q.grad.clone()
            dist.all_reduce(mean)
            torch.testing.assert_close(grad, mean / world, atol=1e-5, rtol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()


def test_fsdp2_fully_shard_two_gloo_ranks():
    """FSDP2's fully_shard on lssar.nn.Attention layers (one with a learned per-head scale, a
    parameter like the others) and the model around them, 2 gloo ranks: the loss and the
    gradients averaged over the ranks equal the unsharded model's."""
    torch.multiprocessing.spawn(_fsdp_rank, args=(2, _free_port()), nprocs=2, join=True)
