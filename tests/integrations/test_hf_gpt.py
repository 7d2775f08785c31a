"""The lssar GPT as a Hugging Face model (lssar.integrations.hf_gpt): it matches the GPT, generates
with a cache and padding, takes packed batches, keeps key norms, checks its config."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DynamicCache,
)

from lssar.integrations import hf  # noqa: E402
from lssar.model import GPT, GPTConfig  # noqa: E402
from tests.integrations.hf_models import ATOL, flattened, pad, ragged  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    hf.register()


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------- the lssar GPT as HF model


def tiny_gpt(attn: str = "lssar", seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    return GPT(GPTConfig(**{**cfg, "attn": attn, **kw})).eval()


@pytest.mark.parametrize("attn", ["lssar", "softmax", "ssmax"])
def test_gpt_wrapper_matches_gpt_and_round_trips(attn, tmp_path):
    from safetensors import safe_open

    gpt = tiny_gpt(attn, attn_options={"p": 3.0} if attn == "lssar" else {})
    if attn == "ssmax":  # the learned per-head scales must travel with the weights
        with torch.no_grad():
            for b in gpt.blocks:
                b.attn.ssmax_s.uniform_(0.2, 0.9)
    model = hf.LssarGPTForCausalLM.from_gpt(gpt, tokenizer="byte", train_seq_len=64)
    x = torch.randint(0, 256, (2, 12))
    logits = model(x).logits
    torch.testing.assert_close(logits, gpt(x)[0], atol=1e-6, rtol=0)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "gpt.wte.weight" in keys and "gpt.head.weight" not in keys  # tied: stored once
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "lssar-gpt" and cfg["attn"] == attn
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, hf.LssarGPTForCausalLM)
    assert loaded.gpt.head.weight.data_ptr() == loaded.gpt.wte.weight.data_ptr()
    assert loaded.gpt.attn_spec == gpt.attn_spec
    assert torch.equal(loaded(x).logits, logits)


def test_gpt_wrapper_generate_cache_padding_labels():
    gpt = tiny_gpt("lssar")
    model = hf.LssarGPTForCausalLM.from_gpt(gpt)
    x = torch.randint(0, 256, (2, 7))
    gen = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, gpt.generate(x, 8, temperature=0))
    # Incremental decoding with HF's cache equals the full forward.
    full = model(x).logits
    cache = DynamicCache()
    model(x[:, :4], cache=cache, use_cache=True)
    for t in range(4, 7):
        step = model(x[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, full[:, t], atol=ATOL, rtol=0)
    # Padding: positions and N_i from the mask; left-padded generate equals one-by-one.
    seqs = ragged()
    for left in (False, True):
        ids, mask = pad(seqs, left)
        logits = model(ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            torch.testing.assert_close(
                logits[i, mask[i].bool()], gpt(s[None])[0][0], atol=ATOL, rtol=0
            )
    ids, mask = pad(seqs, left=True)
    gen = model.generate(
        ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    for i, s in enumerate(seqs):
        assert torch.equal(
            gen[i, ids.shape[1] :], gpt.generate(s[None], 5, temperature=0)[0, len(s) :]
        )
    # Labels: HF convention (shifted inside) equals the GPT's next-token loss.
    loss = model(x, labels=x).loss
    torch.testing.assert_close(loss, gpt(x[:, :-1], x[:, 1:])[1], atol=1e-6, rtol=0)
    as_tuple = model(x, labels=x, use_cache=False, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], loss)


@pytest.mark.parametrize("attn", ["lssar", "softmax"])
def test_gpt_wrapper_packed_batch_matches_each_sequence(attn):
    """The lssar-gpt model reads a flattened batch as flash_attention_2 does (position ids,
    or cu_seq_lens_*): each sequence within itself, RoPE at its own positions, not cached."""
    gpt = tiny_gpt(attn).double()
    model = hf.LssarGPTForCausalLM.from_gpt(gpt)
    seqs = ragged()
    for flash_kwargs in (False, True):
        out = model(**flattened(seqs, return_flash_attn_kwargs=flash_kwargs))
        assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None
        start = 0
        for s in seqs:
            alone = gpt(s[None])[0][0]
            torch.testing.assert_close(out.logits[0, start : start + len(s)], alone)
            start += len(s)
    cu = torch.tensor([0, 5, 13, 16], dtype=torch.int32)
    cache = DynamicCache()
    model(seqs[0][None], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="cannot continue a KV cache"):
        model(torch.cat(seqs)[None], cache=cache, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_gpt_wrapper_bad_inputs():
    model = hf.LssarGPTForCausalLM.from_gpt(tiny_gpt("lssa"))
    with pytest.raises(ValueError, match="token ids must be in"):
        model(torch.tensor([[1, 300]]))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="unknown attention variant"):
        hf.LssarGPTConfig(attn="nope")
    with pytest.raises(ValueError, match=r"does not run variant 'lssar'"):
        hf.LssarGPTConfig(attn="lssar", attn_impl="sdpa")
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(torch.tensor([[1, 2]]), output_attentions=True)


def test_hf_config_takes_hf_names_like_its_own():
    cfg = hf.LssarGPTConfig(num_attention_heads=8, hidden_size=64, num_key_value_heads=2)
    assert (cfg.n_head, cfg.n_embd, cfg.n_kv_head, cfg.head_dim) == (8, 64, 2, 8)
    assert cfg.gpt_config().n_kv_head == 2


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(n_head=0), r"n_head=0 must be a whole number >= 1"),
        (dict(num_attention_heads=-2), r"n_head=-2 must be"),
        (dict(n_embd=-128), r"n_embd=-128 must be"),
        (dict(hidden_size=0), r"n_embd=0 must be"),
        (dict(n_kv_head=0), r"n_kv_head=0 must be"),
        (dict(num_key_value_heads=-1), r"n_kv_head=-1 must be"),
        (dict(mlp_ratio=0.0), r"mlp_ratio=0.0 must be > 0"),
        (dict(n_layer=0), r"n_layer=0 must be"),
        (dict(rope_base=0.0), r"rope_base=0.0 must be > 0"),
    ],
)
def test_hf_config_refuses_bad_sizes(kw, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        hf.LssarGPTConfig(**kw)
    # the same from a config.json on disk (what from_pretrained reads)
    cfg = hf.LssarGPTConfig().to_dict()
    names = {"num_attention_heads": "n_head", "hidden_size": "n_embd"}
    names["num_key_value_heads"] = "n_kv_head"
    cfg.update({names.get(k, k): v for k, v in kw.items()})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        hf.LssarGPTConfig.from_pretrained(tmp_path)


def test_gpt_wrapper_keeps_key_norms_across_steps_until_the_cache_changes(monkeypatch):
    """The lssar-gpt model over HF's DynamicCache: each step computes the norms of its new keys
    only, while the cache's keys are the tensor the previous step returned; reordering the
    batch (beam search) replaces that tensor and the norms start over, still correct."""
    import lssar.model as model_mod

    computed = []
    real = model_mod.key_inverse_norms
    monkeypatch.setattr(
        model_mod, "key_inverse_norms", lambda k: computed.append(k.shape[2]) or real(k)
    )
    model = hf.LssarGPTForCausalLM.from_gpt(tiny_gpt("lssar"))
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    full = model(x).logits
    cache = DynamicCache()
    computed.clear()
    model(x[:, :5], cache=cache, use_cache=True)
    for t in range(5, 7):
        step = model(x[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, full[:, t], atol=ATOL, rtol=0)
    assert computed == [5, 5, 1, 1, 1, 1]  # 2 layers: the prompt's keys, then one key a step
    computed.clear()
    cache.reorder_cache(torch.tensor([1, 0]))
    step = model(x[[1, 0], 7:8], cache=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full[[1, 0], 7], atol=ATOL, rtol=0)
    assert computed == [8, 8]  # every key again: the reordered cache is another tensor
