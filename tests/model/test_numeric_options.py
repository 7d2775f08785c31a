"""Reliability of the model against hostile options: a window or sink count of any size, RoPE
factors and bases checked by what they compute (finite, or a clear error), a temperature near 0
that samples the greedy token."""

from __future__ import annotations

import sys

import pytest
import torch

import lssar
from lssar.model import GPT, GPTConfig
from tests.accuracy import err


def test_the_model_takes_a_window_of_any_size():
    model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16, attn="lssar")).eval()
    idx = torch.randint(0, 32, (1, 10))
    with torch.no_grad():
        full = model(idx)[0]
        assert err(model(idx, window=sys.maxsize)[0], full) == 0
        assert err(model(idx, window=2**80, sink_tokens=2**70)[0], full) == 0


# ------------------------------------------------------------------- numeric options (RoPE)


def _rope_model(**kw) -> GPT:
    return GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16, **kw))


@pytest.mark.parametrize(
    "kind,factor",
    [("linear", 1e-45), ("ntk", 1e300), ("dynamic-ntk", 1e300), ("ntk", 1e-300), ("yarn", 1e-45)],
)
def test_a_rope_factor_is_checked_by_what_it_computes(kind, factor):
    """``--rope-factor 1e-45`` gave NaN losses (frequencies / 1e-45 = inf); ``--rope-scaling ntk
    --rope-factor 1e300`` passed the flag check and ended in an OverflowError traceback."""
    model = _rope_model()
    with pytest.raises(ValueError, match=f"--rope-scaling {kind} --rope-factor .* not finite"):
        model.switch(rope_scaling=kind, rope_factor=factor, train_len=16)
    assert model.rope_scaling is None  # refused before anything changed


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic-ntk", "yarn"])
@pytest.mark.parametrize("factor", [None, 0.5, 16.0, 1e6])
def test_usable_rope_factors_stay_finite(kind, factor):
    model = _rope_model().eval()
    model.switch(rope_scaling=kind, rope_factor=factor, train_len=8)
    with torch.no_grad():
        assert model(torch.randint(0, 32, (1, 64)))[0].isfinite().all()


@pytest.mark.parametrize("base", [1e-300, 1e-60, float("inf"), 0.0, -1.0])
def test_a_rope_base_is_checked_by_what_it_computes(base):
    with pytest.raises(ValueError, match="rope_base"):
        _rope_model(rope_base=base)
    with pytest.raises(ValueError, match="rope_base"):  # the attention module on its own
        lssar.nn.Attention(16, 2, pos="rope", rope_base=base)


@pytest.mark.parametrize("temperature", [1e-45, 1e-30])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    """``temperature=1e-45`` scaled the logits to inf (softmax NaN, a multinomial traceback);
    near 0 it is greedy."""
    model = _rope_model().eval()
    idx = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(9))
    greedy = model.generate(idx, 6, temperature=0)
    gen = torch.Generator().manual_seed(0)
    got = model.generate(idx, 6, temperature=temperature, generator=gen)
    assert got.shape == (2, 11) and torch.equal(got, greedy)
