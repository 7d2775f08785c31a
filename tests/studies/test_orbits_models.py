"""The orbits study's models (lssar.studies.orbits.models): the window is the causal band, a
windowed model sees only its window, arms share their initial weights; the masses read only by the
ideal estimator, standardised on the training split."""

import numpy as np
import pytest
import torch

from lssar.studies.orbits import kepler, symreg
from lssar.studies.orbits.models import (
    OrbitGPT,
    OrbitModelConfig,
    encode_splits,
    finetune_force,
    predict_force,
)


def test_window_is_the_causal_band():
    """The locality control runs lssar.attention's window (O(L W)): the hidden states of the
    dense causal band mask it replaced (query i sees keys i - w < j <= i); w < 1 is an error."""
    n, w = 17, 3
    torch.manual_seed(0)
    model = OrbitGPT(OrbitModelConfig(n_layer=2, n_head=2, n_embd=16, window=w)).eval()
    b = _batch(L=n)
    i = torch.arange(n)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < w)
    with torch.no_grad():
        torch.testing.assert_close(model(b), model.trunk.body(model.embed(b), attn_mask=band))
    model.cfg.window = 0
    with pytest.raises(ValueError, match="window=0 must be a whole number >= 1"):
        model(b)


def _batch(L=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, L, 2, generator=g)
    special = torch.zeros(2, L, dtype=torch.long)
    special[:, 0] = 1
    return {"x": x, "special": special, "dt": torch.zeros(2)}


def test_windowed_model_sees_only_its_window():
    w = 4
    torch.manual_seed(0)
    model = OrbitGPT(OrbitModelConfig(n_layer=1, n_head=2, n_embd=16, window=w)).eval()
    b = _batch()
    h = model(b)
    i = 12
    far, near = _batch(), _batch()
    far["x"][:, i - w] += 1.0  # just outside the window of token i (one layer: no relay)
    near["x"][:, i - w + 1] += 1.0
    with torch.no_grad():
        assert torch.allclose(model(far)[:, i], h[:, i], atol=1e-6)
        assert not torch.allclose(model(near)[:, i], h[:, i], atol=1e-4)


def test_arms_share_initial_weights_and_wide_window_is_exact():
    def build(**kw):
        torch.manual_seed(3)
        return OrbitGPT(OrbitModelConfig(n_layer=2, n_head=2, n_embd=16, **kw)).eval()

    soft, local, lssar = build(), build(window=4), build(attn="lssar", attn_options={"p": 15.0})
    for other in (local, lssar):
        sd = other.state_dict()
        assert all(torch.equal(v, sd[k]) for k, v in soft.state_dict().items())
    wide = build(window=10_000)
    b = _batch()
    with torch.no_grad():
        assert torch.allclose(wide(b), soft(b), atol=1e-5)
        assert not torch.allclose(local(b), soft(b), atol=1e-4)


def _mass_batch(n=6, L=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    special = torch.zeros(n, L, dtype=torch.long)
    special[:, 0] = 1
    return {
        "x": torch.randn(n, L, 2, generator=g),
        "special": special,
        "dt": torch.zeros(n),
        "log_m": torch.randn(n, 2, generator=g),
    }


def test_only_the_ideal_estimator_reads_the_masses():
    def build(**kw):
        torch.manual_seed(5)
        return OrbitGPT(OrbitModelConfig(n_layer=1, n_head=2, n_embd=16, **kw)).eval()

    plain, ideal = build(), build(sees_masses=True)
    sd = ideal.state_dict()  # every shared weight initialised as in the other arms
    assert all(torch.equal(v, sd[k]) for k, v in plain.state_dict().items())
    assert set(sd) - set(plain.state_dict()) == {"mass_in.weight", "mass_in.bias"}
    b = _mass_batch()
    other = dict(b, log_m=b["log_m"] + 1.0)
    with torch.no_grad():
        assert torch.equal(plain(b), plain(other))
        h, h2 = ideal(b), ideal(other)
        assert not torch.allclose(h[:, 1:], h2[:, 1:], atol=1e-4)  # every token, not just one


def test_encoded_masses_are_standardised_on_train():
    raw = {
        s: kepler.generate(kepler.preset("quick", n_systems=n, n_steps=8, seed=i))
        for i, (s, n) in enumerate((("train", 200), ("probe", 40), ("test", 40)))
    }
    data = encode_splits(raw, "continuous")
    lm = data.tokens["train"]["log_m"].numpy()
    assert lm.shape == (200, 2)
    assert np.allclose(lm.mean(0), 0, atol=1e-5) and np.allclose(lm.std(0), 1, atol=1e-4)
    m = np.log(raw["test"]["masses"])
    mu, sd = np.log(raw["train"]["masses"]).mean(0), np.log(raw["train"]["masses"]).std(0)
    assert np.allclose(data.tokens["test"]["log_m"].numpy(), (m - mu) / sd, atol=1e-5)


def test_ideal_estimator_reads_the_mass_exponents_a_blind_probe_cannot(one_thread):
    """Known answer: log F = log m1 + log m2 - 2 log r. Fine-tuned briefly on the same systems
    from the same initialisation, the probe told the masses returns mass exponents near 1; the
    same probe without them (and no pretraining to infer them from the motion) returns ~0."""
    d = kepler.generate(
        kepler.preset("quick", n_systems=400, n_steps=16, dt=0.15, a_range=(0.7, 1.4))
    )
    split = {"train": slice(0, 200), "probe": slice(200, 300), "test": slice(300, 400)}
    raw = {s: {k: v if v.ndim == 0 else v[i] for k, v in d.items()} for s, i in split.items()}
    data = encode_splits(raw, "continuous")
    first = 4
    mu, sd = data.log_f["probe"].mean(), data.log_f["probe"].std()
    target = torch.from_numpy(((data.log_f["probe"] - mu) / sd).astype(np.float32))
    x = [np.repeat(data.masses["test"][:, i], 16 - first) for i in (0, 1)]
    x.append(data.r["test"][:, first:].ravel())
    fits = {}
    for sees in (False, True):
        torch.manual_seed(0)
        model = OrbitGPT(OrbitModelConfig(n_layer=1, n_head=2, n_embd=32, sees_masses=sees))
        finetune_force(model, data.tokens["probe"], target, first, 150, 32, 3e-3, seed=0)
        pred = predict_force(model, data.tokens["test"], first, 16) * sd + mu
        fits[sees] = symreg.power_law_fit(*x, np.exp(pred.ravel()), n_boot=1)
    assert abs(fits[True]["alpha"] - 1) < 0.2 and abs(fits[True]["beta"] - 1) < 0.2
    assert fits[False]["alpha"] < 0.5 and fits[False]["beta"] < 0.5
