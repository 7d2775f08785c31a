"""Positions: ALiBi's slopes and every RoPE scaling against transformers' own definitions
(``ROPE_INIT_FUNCTIONS``, Llama's rotary embedding, BLOOM's slopes) on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from lssar.model import rope_cache  # noqa: E402
from lssar.positions import (  # noqa: E402
    ROPE_SCALINGS,
    RopeScaling,
    alibi_slopes,
    hf_rope_parameters,
    trained_inv_freq,
)

L, BASE = 128, 10000.0
TOL = dict(atol=1e-6, rtol=1e-6)


def _llama(d: int, params: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=2 * d,
        num_attention_heads=2,
        head_dim=d,
        max_position_embeddings=L,
        rope_parameters=dict(params),
    )


def _hf(kind: str, factor: float) -> dict:
    """Our scaling as transformers' ``rope_parameters`` (what the HF export writes)."""
    return hf_rope_parameters(RopeScaling(kind, factor), L, BASE)


@pytest.mark.parametrize("n", list(range(1, 17)) + [24, 32, 40])
def test_alibi_slopes_are_press_et_al_as_bloom_computes_them(n):
    # BLOOM raises a float32 base to integer powers (a few roundings), we compute in float64
    torch.testing.assert_close(alibi_slopes(n), _get_alibi_slopes(n, "cpu"), atol=0, rtol=1e-6)


def test_alibi_slopes_geometric_and_non_power_of_two_rule():
    assert alibi_slopes(8).tolist() == [2.0 ** (-i) for i in range(1, 9)]  # 2^(-8i/8)
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^(-0.5 (2i+1)))
    want = [2.0 ** (-i) for i in range(1, 9)] + [2.0 ** (-0.5 * k) for k in (1, 3, 5, 7)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(want), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="n_head must be >= 1"):
        alibi_slopes(0)


@pytest.mark.parametrize("kind", ["linear", "dynamic-ntk", "yarn"])
@pytest.mark.parametrize("factor", [2.0, 3.5, 16.0])
@pytest.mark.parametrize("d", [16, 64, 100])
@pytest.mark.parametrize("seq_len", [64, 128, 512, 2048])
def test_inverse_frequencies_and_attention_factor_match_transformers(kind, factor, d, seq_len):
    params = _hf(kind, factor)
    inv, att = ROPE_INIT_FUNCTIONS[params["rope_type"]](_llama(d, params), "cpu", seq_len=seq_len)
    ours, factor_ours = RopeScaling(kind, factor).frequencies(d, BASE, L, seq_len)
    torch.testing.assert_close(ours, inv, **TOL)
    assert factor_ours == pytest.approx(att, abs=1e-6)


@pytest.mark.parametrize("s", [2.0, 5.0, 16.0])
@pytest.mark.parametrize("d", [16, 64])
def test_static_ntk_is_transformers_dynamic_at_f1_and_default_with_the_scaled_base(s, d):
    """transformers has no static NTK type: NTK-aware scaling by s is its dynamic NTK with
    factor 1 at length s L, and its default RoPE with rope_theta = b s^(d / (d - 2))."""
    ours, att = RopeScaling("ntk", s).frequencies(d, BASE, L, 7)
    dyn = _llama(d, {"rope_type": "dynamic", "factor": 1.0})
    inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](dyn, "cpu", seq_len=int(s * L))
    torch.testing.assert_close(ours, inv, **TOL)
    theta = BASE * s ** (d / (d - 2))
    default = LlamaRotaryEmbedding.compute_default_rope_parameters(
        LlamaConfig(hidden_size=2 * d, num_attention_heads=2, head_dim=d, rope_theta=theta)
    )[0]
    torch.testing.assert_close(ours, default, **TOL)
    assert att == 1.0


@pytest.mark.parametrize("kind", ROPE_SCALINGS)
def test_auto_is_the_length_multiple_and_the_trained_rope_at_1x(kind):
    auto = RopeScaling(kind, "auto")
    assert auto.factor is None and auto.label == f"{kind} auto"
    for t in (1, 64, 128):  # up to the training length: the trained rotation, bit for bit
        inv, att = auto.frequencies(32, BASE, L, t)
        assert torch.equal(inv, trained_inv_freq(BASE, 32)) and att == 1.0
        assert torch.equal(
            rope_cache(32, torch.arange(t), BASE, auto, L)[0],
            rope_cache(32, torch.arange(t), BASE)[0],
        )
    assert torch.equal(RopeScaling("dynamic-ntk", 3.0).frequencies(32, BASE, L, L)[0], inv)
    for m in (2, 16):  # at m x L: the rule with s = m (dynamic NTK: f = 1, scale m by itself)
        fixed = RopeScaling(kind, 1.0 if kind == "dynamic-ntk" else float(m))
        (a_inv, a_att), (f_inv, f_att) = (r.frequencies(32, BASE, L, m * L) for r in (auto, fixed))
        assert torch.equal(a_inv, f_inv) and a_att == f_att
    assert RopeScaling("dynamic-ntk", 1.0) == RopeScaling("dynamic-ntk")  # one label per rule


@pytest.mark.parametrize("kind", ["linear", "dynamic-ntk", "yarn"])
def test_cos_sin_are_llamas_rotary_embedding(kind):
    """Our rope_cache with a scaling gives Llama's cos/sin (attention factor included) for the
    same position ids, beyond the training length too; Llama's module repeats the halves. The
    inverse frequencies agree to a float32 rounding (the test above), so the angles pos * inv
    agree to about pos roundings: the tolerance grows with the largest position."""
    d, factor = 32, 4.0
    rotary = LlamaRotaryEmbedding(_llama(d, _hf(kind, factor)))
    for t in (100, 4 * L):
        pos = torch.arange(t)
        cos, sin = rope_cache(d, pos, BASE, RopeScaling(kind, factor), L)
        hf_cos, hf_sin = rotary(torch.zeros(1, t, d), pos[None])
        tol = dict(atol=1e-6 + 2.5e-7 * t, rtol=0)
        torch.testing.assert_close(torch.cat([cos, cos], -1), hf_cos[0], **tol)
        torch.testing.assert_close(torch.cat([sin, sin], -1), hf_sin[0], **tol)


def test_yarn_temperature_is_the_papers():
    for s in (2.0, 8.0, 16.0):
        assert RopeScaling("yarn", s).frequencies(64, BASE, L, 1)[1] == 0.1 * math.log(s) + 1
    assert RopeScaling("yarn", 0.5).frequencies(64, BASE, L, 1)[1] == 1.0  # s <= 1: none


def test_labels_slugs_and_the_hf_form_round_trip():
    assert (
        RopeScaling("yarn", 16).label == "yarn x16" and RopeScaling("yarn", 16).slug() == "yarn_x16"
    )
    assert RopeScaling("linear", 2.5).slug() == "linear_x2p5"
    for kind in ROPE_SCALINGS:
        r = RopeScaling(kind, 4.0)
        assert RopeScaling.from_hf(hf_rope_parameters(r, L, BASE)) == r
    assert RopeScaling("dynamic-ntk").to_hf()["factor"] == 1.0
    with pytest.raises(ValueError, match="auto depends on the evaluated length"):
        RopeScaling("yarn").to_hf()
    with pytest.raises(ValueError, match="rope_type 'longrope' is not one lssar-gpt runs"):
        RopeScaling.from_hf({"rope_type": "longrope"})


@pytest.mark.parametrize(
    "kind,factor,match",
    [
        (
            "xpos",
            None,
            r"unknown --rope-scaling 'xpos'; choose one of: linear, ntk, dynamic-ntk, yarn",
        ),
        ("yarn", 0, r"--rope-factor must be a number > 0 or 'auto', got 0"),
        ("yarn", -2.0, r"--rope-factor must be a number > 0"),
        ("yarn", "big", r"--rope-factor must be a number > 0 or 'auto', got 'big'"),
        ("yarn", float("inf"), r"--rope-factor must be a number > 0"),
        (None, 4.0, r"--rope-factor needs --rope-scaling \(one of: linear"),
    ],
)
def test_bad_rope_flags(kind, factor, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling.from_flags(kind, factor)
    assert RopeScaling.from_flags(None, None) is None
    assert RopeScaling.from_flags("ntk", "16") == RopeScaling("ntk", 16.0)
