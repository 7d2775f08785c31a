"""The GPT: KV-cache decoding equals a full forward, no length cap, attention switching."""

from __future__ import annotations

import pytest
import torch

from lssar.model import GPT, GPTConfig, KVCache
from tests.model.tiny_model import _model


@pytest.mark.parametrize(
    "attn,opts",
    [
        ("softmax", {}),
        ("lssa", {}),
        ("lssar", {}),
        ("lssar", {"p": 3.0}),
        ("ssmax", {}),
        ("softmax-qknorm-learned", {"n": 16}),
        ("lssa-const", {"n": 16}),
    ],
)
@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_incremental_decoding_matches_full_forward(attn, opts, n_kv_head):
    model = _model(attn, attn_options=opts, n_kv_head=n_kv_head)
    idx = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(2)
        parts = [model(idx[:, :6], cache=cache)[0]]
        for t in range(6, 21):
            parts.append(model(idx[:, t : t + 1], cache=cache)[0])
    assert cache.length == 21
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-10)


def test_generate_is_greedy_argmax_of_full_forward():
    model = _model("lssar")
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 6, temperature=0.0)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[0][:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


def test_runs_far_beyond_any_training_length_and_returns_weights():
    model = _model("lssar")
    idx = torch.randint(0, 64, (1, 700))
    weights: list[torch.Tensor] = []
    with torch.no_grad():
        logits, loss = model(idx, idx, weights=weights)
    assert logits.shape == (1, 700, 64) and torch.isfinite(loss)
    assert len(weights) == 2 and weights[0].shape == (1, 4, 700, 700)
    assert torch.allclose(weights[1].sum(-1), torch.ones(1, 4, 700, dtype=torch.float64))


def test_attention_can_be_switched_for_evaluation():
    model = _model("lssa")
    idx = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        base, _ = model(idx)
        model.set_attention("lssar", {"p": 15.0})
        sharp, _ = model(idx)
        model.set_attention("lssa")
        again, _ = model(idx)
    assert not torch.allclose(base, sharp) and torch.equal(base, again)
    with pytest.raises(ValueError, match="cannot switch to ssmax"):
        model.set_attention("ssmax")
    with pytest.raises(ValueError, match="cannot switch to softmax-qknorm-learned"):
        model.set_attention("softmax-qknorm-learned")


def test_learned_scale_is_a_per_head_parameter_that_trains():
    """softmax-qknorm-learned: one s per head and layer, from 1 (the constant scale of n), in
    the state dict under ssmax_s (as ssmax's), moved by a gradient step."""
    model = _model("softmax-qknorm-learned", attn_options={"n": 16}).train()
    s = model.blocks[0].attn.ssmax_s
    assert s.shape == (4,) and torch.equal(s, torch.ones(4, dtype=torch.float64))
    assert "blocks.1.attn.ssmax_s" in model.state_dict()
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    _, loss = model(idx, idx)
    loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert _model("softmax-qknorm-const").blocks[0].attn.ssmax_s is None
    with pytest.raises(ValueError, match="takes no option"):
        model.set_attention("relu", {"p": 3.0})


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(n_embd=30), "divisible by n_head"),
        (dict(n_embd=36, n_head=4), "must be even"),
        (dict(n_kv_head=3), "divisible by n_kv_head"),
        (dict(attn="nope"), "valid variants"),
        (dict(attn="ssmax", attn_options={"s": 1.0}), "learned parameter"),
        (dict(attn="softmax-qknorm-learned", attn_options={"s": 1.0}), "learned parameter"),
        (dict(attn="softmax-qknorm-const", attn_options={"n": 0}), "whole number >= 1"),
        # sizes that once reached a ZeroDivisionError, a torch shape error or a silent n_head
        (dict(n_head=0), r"n_head=0 must be a whole number >= 1"),
        (dict(n_head=-4), r"n_head=-4 must be"),
        (dict(n_embd=-32), r"n_embd=-32 must be"),
        (dict(n_embd=0), r"n_embd=0 must be"),
        (dict(n_kv_head=0), r"n_kv_head=0 must be .*or None"),
        (dict(n_layer=0), r"n_layer=0 must be"),
        (dict(vocab_size=0), r"vocab_size=0 must be"),
        (dict(n_head=2.0), r"n_head=2.0 must be a whole number"),
        (dict(mlp_ratio=0), r"mlp_ratio=0 must be > 0"),
        (dict(mlp_ratio=-1.0), r"mlp_ratio=-1.0 must be > 0"),
        (dict(mlp_ratio=0.01), r"leaves the MLP no hidden unit"),
        (dict(mlp_ratio=float("nan")), r"mlp_ratio=nan must be a finite number"),
        (dict(rope_base=0.0), r"rope_base=0.0 must be > 0"),
        (dict(rope_base=-10.0), r"rope_base=-10.0 must be > 0"),
        (dict(rope_base=float("inf")), r"rope_base=inf must be a finite number"),
        (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
        (dict(dropout=float("nan")), r"dropout=nan must be a finite number"),
        # an impl that cannot run the variant: refused when configured, not at the first step
        (dict(attn="lssar", attn_impl="sdpa"), r"impl 'sdpa' does not run variant 'lssar'"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{"n_embd": 32, "n_head": 4, **kw})


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=float("nan")), r"temperature=nan must be a finite number >= 0"),
        (dict(temperature=float("inf")), r"temperature=inf must be a finite number"),
        (dict(temperature=-1.0), r"temperature=-1.0 must be"),
        (dict(top_k=-5), r"top_k=-5 must be >= 1"),
        (dict(top_k=0), r"top_k=0 must be >= 1 \(or None"),
        (dict(max_new_tokens=-1), r"max_new_tokens=-1 must be >= 0"),
    ],
)
def test_generate_refuses_bad_sampling_settings(kw, match):
    model = _model("softmax")
    with pytest.raises(ValueError, match=match):
        model.generate(torch.tensor([[1, 2]]), **{"max_new_tokens": 3, **kw})


def test_token_ids_out_of_range():
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        _model("softmax")(torch.tensor([[3, 64]]))


def _window(t: int, w: int) -> torch.Tensor:
    i = torch.arange(t)
    return i[None, :] > i[:, None] - w  # (T, T): key j within w of query i (causal added)


@pytest.mark.parametrize("attn", ["softmax", "lssar"])
def test_attn_mask_reaches_every_layer(attn):
    """All-True changes nothing; with a window of w keys in each of 2 layers the last query sees
    exactly the last 2(w-1)+1 tokens (RoPE: only relative positions matter)."""
    model = _model(attn)
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    t, w = idx.shape[1], 6
    reach = 2 * (w - 1) + 1
    with torch.no_grad():
        full, _ = model(idx)
        same, _ = model(idx, attn_mask=torch.ones(t, t, dtype=torch.bool))
        windowed, _ = model(idx, attn_mask=_window(t, w))
        tail, _ = model(idx[:, -reach:], attn_mask=_window(reach, w))
        short, _ = model(idx[:, -reach + 1 :], attn_mask=_window(reach - 1, w))
    torch.testing.assert_close(same, full)
    torch.testing.assert_close(windowed[:, -1], tail[:, -1])
    assert not torch.allclose(windowed[:, -1], short[:, -1])  # one token less is seen
    assert not torch.allclose(windowed[:, -1], full[:, -1])


# ----------------------------------------------------------------------- positions


@pytest.mark.parametrize(
    "pos,attn",
    [
        ("alibi", "softmax"),
        ("alibi", "softmax-qknorm-logn"),
        ("alibi", "ssmax"),
        ("nope", "softmax"),
        ("nope", "lssar"),
    ],
)
@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_alibi_and_nope_decode_incrementally_like_the_full_forward(pos, attn, n_kv_head):
    model = _model(attn, pos=pos, n_kv_head=n_kv_head)
    idx = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(2)
        parts = [model(idx[:, :6], cache=cache)[0]]
        for t in range(6, 21):
            parts.append(model(idx[:, t : t + 1], cache=cache)[0])
        rope = _model(attn, n_kv_head=n_kv_head)(idx)[0]  # same weights, RoPE
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)
    assert not torch.allclose(full, rope)


def _zero_qk(model: GPT) -> None:
    """Zero the q and k rows of every fused projection: scores are 0, only the bias is left."""
    for block in model.blocks:
        block.attn.qkv.weight.data[: 2 * model.cfg.n_embd] = 0


def test_alibi_weights_are_the_softmax_of_the_bias_and_nope_is_uniform():
    from lssar.positions import alibi_slopes

    idx = torch.randint(0, 64, (1, 9))
    alibi, nope = _model("softmax", pos="alibi"), _model("softmax", pos="nope")
    for m in (alibi, nope):
        _zero_qk(m)
    w_alibi, w_nope = [], []
    with torch.no_grad():
        alibi(idx, weights=w_alibi)
        nope(idx, weights=w_nope)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    bias = -alibi_slopes(4).double()[:, None, None] * (i - j).abs()
    want = bias.masked_fill(j > i, float("-inf")).softmax(-1)  # (H, T, T)
    torch.testing.assert_close(w_alibi[1][0], want, atol=1e-12, rtol=0)
    uniform = torch.ones(9, 9, dtype=torch.float64).tril()
    torch.testing.assert_close(w_nope[0][0, 0], uniform / uniform.sum(-1, keepdim=True))


def test_nope_and_alibi_read_no_position_ids():
    for pos in ("alibi", "nope"):
        model = _model("softmax", pos=pos)
        h = model.wte(torch.randint(0, 64, (1, 7)))
        with torch.no_grad():
            a = model.body(h)
            b = model.body(h, positions=torch.arange(100, 107))
        assert torch.equal(a, b), pos


def test_rope_scaling_is_switched_after_training():
    from lssar.positions import RopeScaling

    model = _model("lssar")
    idx = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        base, _ = model(idx)
        model.set_rope_scaling(RopeScaling("yarn"), train_len=64)  # auto, 40 <= 64 tokens: 1x
        same, _ = model(idx)
        model.switch(rope_scaling="yarn", rope_factor=4, train_len=64)
        scaled, _ = model(idx)
        assert model.rope_scaling == RopeScaling("yarn", 4.0) and model.rope_train_len == 64
        model.set_rope_scaling(None)
        again, _ = model(idx)
    assert torch.equal(base, same) and torch.equal(base, again)
    assert not torch.allclose(base, scaled)  # LSSAR + YaRN: the rotation changes (the

    # temperature does not: LSSAR normalises q and k)


@pytest.mark.parametrize("pos", ["alibi", "nope"])
def test_rope_scaling_on_a_model_without_rope_is_an_error(pos):
    model = _model("softmax", pos=pos)
    with pytest.raises(ValueError, match=f"rescales RoPE; this model was trained with pos='{pos}'"):
        model.switch(rope_scaling="yarn", rope_factor=2.0, train_len=16)
    with pytest.raises(ValueError, match="unknown --rope-scaling 'pi'"):
        _model("softmax").switch(rope_scaling="pi", train_len=16)
    with pytest.raises(ValueError, match="needs the training length"):
        _model("softmax").switch(rope_scaling="ntk", rope_factor=2.0)


def test_an_alibi_model_cannot_switch_to_a_variant_it_cannot_bias():
    model = _model("softmax", pos="alibi")
    model.set_attention("softmax-qknorm-logn")  # the softmax family: fine
    with pytest.raises(ValueError, match=r"pos='alibi' biases the scores of the softmax family"):
        model.set_attention("lssar")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(pos="xpos"), r"unknown pos 'xpos'; choose one of: rope, alibi, nope"),
        (dict(pos="alibi", attn="lssar"), r"attn='lssar' cannot take it: use one of those"),
        (dict(pos="alibi", attn="sigmoid"), "pos='alibi' biases the scores"),
    ],
)
def test_bad_position_config(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{"n_embd": 32, "n_head": 4, **kw})
    GPTConfig(n_embd=36, n_head=4, pos="nope")  # an odd head dim is fine without RoPE
