"""The GPT under sliding windows and packed documents (through lssar.attention): a window equals
its dense mask, each document gets its own logits, the refusals, and a default call passes
neither."""

from __future__ import annotations

import pytest
import torch

from lssar.model import GPT, GPTConfig, KVCache
from tests.model.tiny_model import _model

# -------------------------------------------- sliding windows and documents (lssar.attention)


def _band(t: int, w: int, sinks: int = 0) -> torch.Tensor:
    """The dense ``(T, T)`` window mask the window path replaced: key j in ``(i - w, i]``, plus
    the first ``sinks`` keys."""
    i = torch.arange(t)
    m = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < w)
    m[:, :sinks] = True
    return m & (i[None, :] <= i[:, None])


@pytest.mark.parametrize(
    "attn,pos",
    [("softmax", "rope"), ("softmax", "alibi"), ("lssar", "rope"), ("lssa", "nope")],
)
@pytest.mark.parametrize("sinks", [0, 1])
def test_window_equals_the_dense_window_mask(attn, pos, sinks):
    """``window=W`` (lssar.attention's ``window=(W - 1, 0)``, O(T W)) gives the logits, loss and
    weights of the dense ``(T, T)`` band mask, at a length where lssar runs its fused kernel."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, attn=attn, pos=pos))
    model.eval()
    t, w = 150, 24
    idx = torch.randint(0, 64, (2, t), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        dense, dense_loss = model(idx, idx, attn_mask=_band(t, w, sinks))
        band, band_loss = model(idx, idx, window=w, sink_tokens=sinks)
        full, _ = model(idx)
        wd, wb = [], []
        model(idx[:, :40], weights=wd, attn_mask=_band(40, 9, sinks))
        model(idx[:, :40], weights=wb, window=9, sink_tokens=sinks)
    torch.testing.assert_close(band, dense, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(band_loss, dense_loss, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(band, full, atol=1e-3)  # the window hides keys
    for a, b in zip(wb, wd):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_window_must_be_a_positive_count():
    model = _model("softmax")
    with pytest.raises(ValueError, match="window=0 must be a whole number >= 1"):
        model(torch.zeros(1, 4, dtype=torch.long), window=0)
    with pytest.raises(ValueError, match="sink_tokens keeps the first keys visible"):
        model(torch.zeros(1, 4, dtype=torch.long), sink_tokens=1)


EOT = 0


def _packed(lengths_per_row, seed=5):
    """Rows of documents, each beginning with EOT except a row's first (a window cut into the
    middle of a document): ``(idx (B, T), [[doc (T_d,), ...] per row])``."""
    g = torch.Generator().manual_seed(seed)
    rows, docs = [], []
    for lengths in lengths_per_row:
        parts = [torch.randint(1, 64, (n,), generator=g) for n in lengths]
        for p in parts[1:]:
            p[0] = EOT
        rows.append(torch.cat(parts))
        docs.append(parts)
    return torch.stack(rows), docs


@pytest.mark.parametrize(
    "attn,pos",
    [("softmax", "rope"), ("softmax", "alibi"), ("lssar", "rope"), ("lssa", "rope"),
     ("lssar", "nope")],
)  # fmt: skip
def test_documents_give_each_document_its_own_logits(attn, pos):
    """With the documents of a packed batch (EOT-separated), each document's logits and
    per-token loss equal those of the document alone (LSSA's length scale restarts there),
    and differ from the unmasked batch's; RoPE keeps each token's row position (relative)."""
    from lssar.data import eot_documents

    model = _model(attn, pos=pos)
    idx, docs = _packed([(7, 12, 5), (9, 1, 14)])  # (2, 24); a one-token document
    cu = eot_documents(idx, EOT)
    assert cu.tolist() == [0, 7, 19, 24, 33, 34, 48]
    with torch.no_grad():
        logits, loss = model(idx, idx, reduction="none", cu_seqlens=cu)
        plain, _ = model(idx)
        for r, parts in enumerate(docs):
            start = 0
            for d in parts:
                alone, alone_loss = model(d[None], d[None], reduction="none")
                sl = slice(start, start + len(d))
                torch.testing.assert_close(logits[r, sl], alone[0], atol=1e-7, rtol=0)
                torch.testing.assert_close(loss[r, sl], alone_loss[0], atol=1e-6, rtol=0)  # fp32
                start += len(d)
    assert not torch.allclose(logits[:, 7:], plain[:, 7:], atol=1e-3)


def test_documents_weights_and_refusals():
    """Weights of a packed call are ``(1, H, B T, B T)`` and zero across documents; documents
    with a KV cache, or spanning two rows, are refused; one document per row is the plain
    causal call."""
    model = _model("lssar")
    idx, _ = _packed([(10, 6), (16,)])
    cu = torch.tensor([0, 10, 16, 32])
    weights: list[torch.Tensor] = []
    with torch.no_grad():
        model(idx, weights=weights, cu_seqlens=cu)
        whole, _ = model(idx, cu_seqlens=torch.tensor([0, 16, 32]))
        plain, _ = model(idx)
    assert weights[0].shape == (1, 4, 32, 32)
    assert weights[0][..., 10:16, :10].abs().max() == 0 and weights[0][..., 16:, :16].sum() == 0
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(1, 4, 32, dtype=torch.float64))
    torch.testing.assert_close(whole, plain, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="a document cannot span two rows"):
        model(idx, cu_seqlens=torch.tensor([0, 10, 20, 32]))
    with pytest.raises(ValueError, match="cannot be used with a KV cache"):
        model(idx[:1], cache=KVCache(2), cu_seqlens=torch.tensor([0, 16]))


def test_default_call_passes_no_window_or_documents(monkeypatch):
    """The default forward calls lssar.attention exactly as before: no span arguments."""
    import lssar.nn

    seen: list[set[str]] = []
    real = lssar.nn.attention

    def spy(*args, **kwargs):
        seen.append(set(kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(lssar.nn, "attention", spy)
    model = _model("lssar")
    idx = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        model(idx)
        model.generate(idx, 2)
        model(idx, window=4)
    spans = {"window", "sink_tokens", "cu_seqlens", "cu_seqlens_k"}
    # 2 layers x (1 forward + generate's prefill and 1 step for 2 new tokens + 1 windowed)
    assert len(seen) == 2 * 4 and all(not (s & spans) for s in seen[:-2])
    assert all("window" in s for s in seen[-2:])
