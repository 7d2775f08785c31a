"""Tests for lssar.integrations.hf: lssar attention in HF models, the lssar-gpt model, export."""

from __future__ import annotations

import json
import os
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorWithFlattening,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    eager_mask,
    padding_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import lssar  # noqa: E402
from lssar.integrations import hf, packing  # noqa: E402
from lssar.model import GPT, GPTConfig  # noqa: E402
from lssar.ops.variants import VARIANTS  # noqa: E402

ATOL = 1e-5
FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config}
MAIN = ("lssar", "lssa", "softmax")
WORDS = "the a king queen sword crown night day love death speak hear fair foul ho".split()


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    hf.register()


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(family: str, attn: str, seed: int = 0, **extra) -> torch.nn.Module:
    """2 layers, hidden 64, 4 heads, 2 KV heads (GQA), vocab 256, float32, eval mode."""
    cfg = FAMILIES[family](
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def ragged(lengths=(5, 8, 3), seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g) for n in lengths]


def pad(seqs: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (B, T), mask (B, T))`` with pad id 0 on the left or the right."""
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(t - len(s), t) if left else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    return ids, mask


def greedy_by_full_forward(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


# ---------------------------------------------------------------------------- registration


def test_register_every_variant_idempotent():
    assert hf.register() == list(VARIANTS)
    assert hf.register(["lssar"]) == ["lssar"]
    for name in VARIANTS:
        assert name in ALL_ATTENTION_FUNCTIONS.valid_keys()
        assert ALL_MASK_ATTENTION_FUNCTIONS[name] is hf.lssar_mask
    assert {"lssar", "lssa", "softmax"} <= set(VARIANTS)


def test_unknown_name_errors():
    with pytest.raises(ValueError, match="unknown attention variant 'nope'"):
        hf.register(["nope"])
    with pytest.raises(ValueError, match="nope"):
        tiny("llama", "nope")


def test_old_transformers_gets_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    with pytest.raises(ValueError, match=r"transformers >= 4.48 is needed for custom attention"):
        hf._interfaces()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"lssar_p": -1}, r"config.lssar_p=-1: p must be a float in \[2\^-126, 2\^28\]"),
        ({"lssar_options": {"q": 1}}, r"config.lssar_options=.*takes no option 'q'"),
        ({"lssar_options": [3]}, r"config.lssar_options must be a dict"),
        ({"lssar_impl": "warp"}, r"unknown impl 'warp'"),
    ],
)
def test_bad_config_field_is_named(extra, match):
    m = tiny("llama", "lssar", **extra)
    with pytest.raises(ValueError, match=match):
        m(torch.randint(0, 256, (1, 4)))


def test_lssar_p_on_variant_without_p():
    m = tiny("llama", "sigmoid", lssar_p=3.0)
    with pytest.raises(ValueError, match=r"config.lssar_p=3.0: attention 'sigmoid' has no"):
        m(torch.randint(0, 256, (1, 4)))


def test_config_p_reaches_the_kernel():
    x = torch.randint(0, 256, (2, 9))
    p3 = tiny("llama", "lssar-p3")(x).logits
    via_p = tiny("llama", "lssar", lssar_p=3.0)(x).logits
    via_options = tiny("llama", "lssar", lssar_options={"p": 3.0})(x).logits
    p15 = tiny("llama", "lssar")(x).logits
    torch.testing.assert_close(via_p, p3, atol=0, rtol=0)
    torch.testing.assert_close(via_options, p3, atol=0, rtol=0)
    assert (p15 - p3).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["lssar", "lssa"])
def test_impls_agree_under_hf_masks(name):
    """config.lssar_impl picks the kernel; the memory-efficient one honours HF's padding mask."""
    ids, mask = pad(ragged(), left=True)
    ref = tiny("llama", name, lssar_impl="reference")(ids, attention_mask=mask).logits
    fast = tiny("llama", name, lssar_impl="chunked")(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(fast[real], ref[real], atol=ATOL, rtol=0)


# ------------------------------------------------------------- lssar attention in HF models


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", MAIN)
def test_cache_matches_full_forward(family, name):
    m = tiny(family, name)
    assert m.config._attn_implementation == name
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    full = m(x, use_cache=False).logits  # (2, 9, V)
    cache = DynamicCache()
    out = m(x[:, :5], cache=cache, use_cache=True)
    torch.testing.assert_close(out.logits, full[:, :5], atol=ATOL, rtol=0)
    for t in range(5, 9):
        step = m(x[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, full[:, t], atol=ATOL, rtol=0)
    gen = m.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, greedy_by_full_forward(m, x, 6))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", MAIN)
def test_padded_batches_match_single_sequences(family, name):
    m = tiny(family, name)
    seqs = ragged()
    singles = [m(s[None]).logits[0] for s in seqs]
    for left in (False, True):
        ids, mask = pad(seqs, left)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # unpadded positions for left padding
        logits = m(ids, attention_mask=mask, position_ids=pos).logits
        for i in range(len(seqs)):
            real = mask[i].bool()
            torch.testing.assert_close(logits[i, real], singles[i], atol=ATOL, rtol=0)
    # Generation on a left-padded batch: cache + padding + offsets, N_i from the real mask.
    ids, mask = pad(seqs, left=True)
    gen = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for i, s in enumerate(seqs):
        one = m.generate(s[None], max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(gen[i, ids.shape[1] :], one[0, len(s) :])


@pytest.mark.parametrize("name", ["lssar", "lssa"])
def test_static_cache_counts_only_filled_slots(name):
    """A static cache holds empty key slots; HF's SDPA skip would count them in N_i."""
    m = tiny("llama", name)
    ids, mask = pad(ragged(), left=True)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    dynamic = m.generate(ids, attention_mask=mask, **kw)
    static = m.generate(ids, attention_mask=mask, cache_implementation="static", **kw)
    assert torch.equal(dynamic, static)


def test_training_with_dropout_backpropagates():
    m = tiny("qwen2", "lssar", attention_dropout=0.1).train()
    x = torch.randint(0, 256, (2, 10))
    loss = m(x, labels=x).loss
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)
    m.eval()
    torch.testing.assert_close(m(x).logits, m(x).logits, atol=0, rtol=0)  # no dropout in eval


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_matches_sdpa(family):
    ours, ref = tiny(family, "softmax"), tiny(family, "sdpa")
    ref.load_state_dict(ours.state_dict())
    x = torch.randint(0, 256, (2, 11))
    torch.testing.assert_close(ours(x).logits, ref(x).logits, atol=ATOL, rtol=0)
    ids, mask = pad(ragged(), left=False)
    a = ours(ids, attention_mask=mask).logits[mask.bool()]
    b = ref(ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def module_stub() -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(), is_causal=True, training=False)


@pytest.mark.parametrize("name", MAIN)
def test_attention_with_hf_mask_equals_direct_call(name):
    """T_q=6 new queries after 3 cached keys (T_k=9), GQA 4/2, with and without key padding."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    fn = hf.attention_function(name)
    pad_2d = torch.ones(2, 9, dtype=torch.bool)
    pad_2d[1, :2] = False  # left padding of row 1
    for attention_2d in (torch.ones(2, 9, dtype=torch.bool), pad_2d):
        mask = hf.lssar_mask(
            batch_size=2,
            q_length=6,
            kv_length=9,
            q_offset=3,
            kv_offset=0,
            mask_function=causal_mask_function,
            attention_mask=attention_2d,
            allow_is_causal_skip=False,
        )
        assert mask.dtype == torch.bool and mask.shape == (2, 1, 6, 9)
        out, weights = fn(module_stub(), q, k, v, mask, scaling=0.25)
        assert weights is None and out.shape == (2, 6, 4, 16) and out.is_contiguous()
        direct = lssar.attention(
            q,
            k,
            v,
            attention_2d[:, None, None, :],
            is_causal=True,
            scale=None if name != "softmax" else 0.25,
            enable_gqa=True,
            variant=name,
        )
        torch.testing.assert_close(out, direct.transpose(1, 2), atol=1e-6, rtol=0)
    # No mask (HF skipped it): lssar's bottom-right is_causal.
    out, _ = fn(module_stub(), q, k, v, None, scaling=0.25)
    direct = lssar.attention(
        q, k, v, None, is_causal=True, enable_gqa=True, variant=name,
        scale=None if name != "softmax" else 0.25,
    )  # fmt: skip
    torch.testing.assert_close(out, direct.transpose(1, 2), atol=1e-6, rtol=0)


def test_mask_skipped_only_for_plain_causal():
    kw = dict(batch_size=2, mask_function=causal_mask_function)
    ones = torch.ones(2, 9, dtype=torch.bool)
    # Contiguous cache, no padding: None (bottom-right is_causal is the same mask).
    assert hf.lssar_mask(q_length=6, kv_length=9, q_offset=3, kv_offset=0, **kw) is None
    one_query = dict(q_length=1, kv_length=9, q_offset=8, kv_offset=0, attention_mask=ones)
    assert hf.lssar_mask(**one_query, **kw) is None
    padded = ones.clone()
    padded[0, 0] = False
    m = hf.lssar_mask(q_length=6, kv_length=9, q_offset=3, kv_offset=0, attention_mask=padded, **kw)
    ref = sdpa_mask(q_length=6, kv_length=9, q_offset=3, kv_offset=0, attention_mask=padded,
                    allow_is_causal_skip=False, **kw)  # fmt: skip
    assert torch.equal(m, ref)
    # Static-cache prefill: 4 queries, 9 key slots of which 5 are empty. SDPA's skip relies on
    # top-left alignment; lssar must get the real mask (N_i counts only filled slots).
    m = hf.lssar_mask(q_length=4, kv_length=9, q_offset=0, kv_offset=0, **kw)
    assert m is not None and m[0, 0].sum(-1).tolist() == [1, 2, 3, 4]


def test_float_additive_mask_is_converted():
    kw = dict(batch_size=2, q_length=5, kv_length=7, q_offset=2, kv_offset=0)
    pad_2d = torch.ones(2, 7, dtype=torch.bool)
    pad_2d[0, :3] = False
    additive = eager_mask(attention_mask=pad_2d, dtype=torch.float32, **kw)
    boolean = sdpa_mask(attention_mask=pad_2d, allow_is_causal_skip=False, **kw)
    assert torch.equal(hf.bool_mask(additive), boolean)
    assert torch.equal(hf.bool_mask(additive.masked_fill(~boolean, float("-inf"))), boolean)
    with pytest.raises(ValueError, match="biases other than 0"):
        hf.bool_mask(additive + 0.5)
    q = torch.randn(2, 4, 5, 8)
    k = v = torch.randn(2, 2, 7, 8)
    fn = hf.attention_function("lssar")
    a, _ = fn(module_stub(), q, k, v, additive, scaling=0.1)
    b, _ = fn(module_stub(), q, k, v, boolean, scaling=0.1)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_unsupported_kwargs_raise():
    q = k = v = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="does not support `softcap`"):
        hf.attention_function("lssa")(module_stub(), q, k, v, None, softcap=30.0)


# ---------------------------------------------------- packed sequences and sliding windows


def flattened(seqs: list[torch.Tensor], **kw) -> dict:
    """transformers' padding-free batch: the sequences in one row, labels -100 at each start."""
    return DataCollatorWithFlattening(**kw)([{"input_ids": s.tolist()} for s in seqs])


def count_dense_masks(monkeypatch) -> list[int]:
    """Counts the (T_q, T_k) masks lssar_mask builds (it builds them with sdpa_mask)."""
    import transformers.masking_utils as mu

    built: list[int] = []
    real = mu.sdpa_mask

    def spy(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mu, "sdpa_mask", spy)
    return built


@pytest.mark.parametrize("name", ["lssar", "lssa"])
@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.parametrize("use_cache", [False, True])
def test_flattened_batch_matches_each_sequence(name, flash_kwargs, use_cache, monkeypatch):
    """DataCollatorWithFlattening packs 3 sequences into one row (position_ids restarting at 0,
    and with return_flash_attn_kwargs cu_seq_lens_q/k): each sequence's logits equal its own
    forward (float64), the loss is the token-weighted mean of theirs, and no (T, T) mask is
    built: the documents reach lssar.attention as cu_seqlens, from the kwargs or position_ids,
    whether or not transformers itself saw the packing (it does not with a cache)."""
    m = tiny("llama", name).double()
    seqs = ragged()
    batch = flattened(seqs, return_flash_attn_kwargs=flash_kwargs)
    assert ("cu_seq_lens_q" in batch) == flash_kwargs and batch["position_ids"][0, 5] == 0
    built = count_dense_masks(monkeypatch)
    out = m(**batch, use_cache=use_cache)
    assert not built
    start, total, n = 0, 0.0, 0
    for s in seqs:
        alone = m(s[None], labels=s[None], use_cache=False)
        torch.testing.assert_close(out.logits[0, start : start + len(s)], alone.logits[0])
        total, n, start = total + alone.loss * (len(s) - 1), n + len(s) - 1, start + len(s)
    torch.testing.assert_close(out.loss, total / n)
    unpacked = m(batch["input_ids"], use_cache=False).logits  # one sequence: attends across
    assert not torch.allclose(unpacked[0, 5:], out.logits[0, 5:], atol=1e-3)


def test_flattened_rows_of_a_batch_and_explicit_boundaries():
    """Position ids restarting in each of 2 rows (transformers' per-row packing) and explicit
    cu_seq_lens over the flattened rows give the same documents; cu_seq_lens_* with a padding
    mask, packed position ids against cached keys and a bidirectional window without a mask
    are errors."""
    seqs = ragged((4, 6, 5, 5))
    ids = torch.stack([torch.cat(seqs[:2]), torch.cat(seqs[2:])])  # (2, 10)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    m = tiny("llama", "lssar").double()
    a = m(ids, position_ids=pos, use_cache=False).logits
    cu = torch.tensor([0, 4, 10, 15, 20], dtype=torch.int32)
    b = m(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=True).logits
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0, :4], m(seqs[0][None]).logits[0])
    torch.testing.assert_close(a[1, 5:], m(seqs[3][None]).logits[0])
    fn = hf.attention_function("lssar")
    q = k = v = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="came with an attention mask"):
        fn(module_stub(), q, k, v, torch.ones(1, 1, 6, 6, dtype=torch.bool), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="a KV cache holds earlier tokens"):
        fn(module_stub(), q[:, :, :3], k, v, None, position_ids=torch.tensor([[0, 1, 0]]))
    with pytest.raises(ValueError, match="bidirectional sliding window needs its mask"):
        fn(module_stub(), q, k, v, None, is_causal=False, sliding_window=2)
    assert packing.documents({"position_ids": torch.arange(6)[None]}, 1, 6, 6) is None


def windowed(family: str, attn: str, window: int | None = 4) -> torch.nn.Module:
    """``tiny`` with a sliding window of ``window`` keys (Qwen2: in its second layer only)."""
    cfg_class = {"mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    extra: dict = {"sliding_window": window}
    if family == "qwen2" and window is not None:
        extra |= {"use_sliding_window": True, "max_window_layers": 1}
    cfg = cfg_class(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_is_passed_as_a_window(family, monkeypatch):
    """A config's sliding_window reaches lssar.attention as window=(w - 1, 0), without a mask:
    softmax equals transformers' SDPA with the window; LSSAR's cached decoding equals its full
    forward, a padded batch (HF's dense mask) its unpadded row, and a flattened batch each
    sequence alone."""
    x = torch.randint(1, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    ours, ref = windowed(family, "softmax"), windowed(family, "sdpa")
    ref.load_state_dict(ours.state_dict())
    built = count_dense_masks(monkeypatch)
    logits = ours(x).logits
    assert not built
    torch.testing.assert_close(logits, ref(x).logits, atol=ATOL, rtol=0)
    unwindowed = windowed(family, "sdpa", window=None)
    unwindowed.load_state_dict(ours.state_dict())
    assert not torch.allclose(logits, unwindowed(x).logits, atol=1e-3)  # the window matters
    m = windowed(family, "lssar")
    full = m(x, use_cache=False).logits
    cache = DynamicCache(config=m.config)
    torch.testing.assert_close(m(x[:, :6], cache=cache).logits, full[:, :6], atol=ATOL, rtol=0)
    for t in range(6, 13):
        step = m(x[:, t : t + 1], cache=cache).logits[:, -1]
        torch.testing.assert_close(step, full[:, t], atol=ATOL, rtol=0)
    padded = torch.ones(2, 13, dtype=torch.long)
    padded[1, :3] = 0
    dense = m(x, attention_mask=padded, use_cache=False).logits
    torch.testing.assert_close(dense[0], full[0], atol=ATOL, rtol=0)
    seqs = [x[0, :9], x[1, :7]]
    packed = m(**flattened(seqs), use_cache=False).logits[0]
    torch.testing.assert_close(packed[:9], m(seqs[0][None]).logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[9:], m(seqs[1][None]).logits[0], atol=ATOL, rtol=0)


def test_mask_rule_reads_only_what_lssar_can_express():
    """Causal, a causal sliding window and packed sequences are read from transformers' mask
    functions; anything else (padding inside, chunked attention, a custom function) gives None,
    and lssar_mask then builds the dense mask."""
    assert packing.mask_rule(causal_mask_function) == {"causal"}
    assert packing.mask_rule(sliding_window_causal_mask_function(4)) == {"causal", "window"}
    pad_2d = torch.ones(1, 6, dtype=torch.bool)
    for fn in (
        chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
        and_masks(causal_mask_function, padding_mask_function(pad_2d)),
        lambda b, h, q, kv: kv <= q,
    ):
        assert packing.mask_rule(fn) is None
        kw = dict(batch_size=1, q_length=6, kv_length=6, q_offset=0, kv_offset=0)
        assert hf.lssar_mask(mask_function=fn, **kw) is not None
    window = dict(batch_size=1, q_length=6, kv_length=6, q_offset=0, kv_offset=0, local_size=4)
    assert hf.lssar_mask(mask_function=sliding_window_causal_mask_function(4), **window) is None


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


# ------------------------------------------------------------------------------ export


def make_tiny_run(root: Path, attn: str = "lssa", pos: str = "rope", name: str = "tiny") -> Path:
    """A finished 2-step training run on a small local byte-level corpus (a few seconds)."""
    from lssar import data
    from lssar.train import TrainConfig, train

    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    r = random.Random(0)
    for i in range(6):
        lines = (" ".join(r.choice(WORDS) for _ in range(8)) for _ in range(60))
        (corpus / f"d{i}.txt").write_text("\n".join(lines))
    d = data.prepare(str(corpus), "byte", out_dir=root / "data", progress=False, val_fraction=0.3)
    cfg = TrainConfig(
        data_dir=str(d), tokenizer="byte", n_layer=1, n_head=2, n_embd=32, seq_len=32,
        batch_size=2, max_steps=2, warmup_steps=1, eval_every=2, eval_tokens=64, ckpt_every=2,
        log_every=1, out_dir=str(root / "runs"), run_name=name, device="cpu", attn=attn,
        dtype="fp32", pos=pos,
    )  # fmt: skip
    return train(cfg, progress=False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return make_tiny_run(tmp_path_factory.mktemp("run"))


def test_export_run_round_trip(tiny_run, tmp_path):
    from lssar.cli import main
    from lssar.train import load_run

    out = tmp_path / "hf"
    assert main(["export-hf", str(tiny_run), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", hf.TOKENIZER_INFO} <= names
    info = json.loads((out / hf.TOKENIZER_INFO).read_text())
    assert info["name"] == "byte" and info["vocab_size"] == 256 and info["step"] == 2
    gpt, cfg, _ = load_run(tiny_run)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.lssar_tokenizer == "byte" and model.config.train_seq_len == cfg.seq_len
    x = torch.randint(0, 256, (2, 20))
    torch.testing.assert_close(model(x).logits, gpt(x)[0], atol=1e-6, rtol=0)
    tok = AutoTokenizer.from_pretrained(out)
    text = "Señor ♥ the king\n\n  speaks."
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    with pytest.raises(FileExistsError, match="not empty"):
        hf.export_run(tiny_run, out)
    assert main(["export-hf", str(tiny_run / "missing"), str(tmp_path / "x")]) == 2


def test_export_never_touches_a_users_files(tiny_run, tmp_path, capsys):
    from lssar.cli import main

    mine = tmp_path / ".hf.tmp"  # the fixed temp name of an earlier version: a user's folder
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["export-hf", str(tiny_run), str(tmp_path / "hf")]) == 0
    assert (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.tmp", "hf"]  # no temp left
    target = tmp_path / "model.bin"
    target.write_bytes(b"a file")
    capsys.readouterr()  # the first export's progress output
    assert main(["export-hf", str(tiny_run), str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a directory" in err
    assert target.read_bytes() == b"a file"


def test_bpe_tokenizer_export_matches_lssar(tmp_path):
    from lssar.data import get_tokenizer, train_bpe

    texts = [" ".join(random.Random(i).choices(WORDS, k=40)) for i in range(40)]
    train_bpe(texts, 300, tmp_path / "tokenizer.json")
    ours, theirs = get_tokenizer("bpe-300", tmp_path), hf.hf_tokenizer("bpe-300", tmp_path)
    text = "the king speaks, Señor; foul is fair\n\n ho"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.eos_token_id == ours.eot


def test_gpt2_tokenizer_export_matches_lssar():
    pytest.importorskip("tiktoken")
    from lssar.data import get_tokenizer

    ours, theirs = get_tokenizer("gpt2"), hf.hf_tokenizer("gpt2")
    text = "Hello world! Señor ♥ it's 12345 tokens...\n\n  The pass key is 98765."
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.eos_token_id == ours.eot


@pytest.mark.parametrize(
    "attn,pos,flags,written",
    [
        ("softmax", "alibi", [], {"pos": "alibi"}),
        ("softmax-qknorm-logn", "alibi", [], {"pos": "alibi"}),
        ("lssar", "nope", [], {"pos": "nope"}),
        ("softmax", "rope", ["--rope-scaling=yarn", "--rope-factor=4"], {"rope_type": "yarn"}),
        ("softmax", "rope", ["--rope-scaling=linear", "--rope-factor=2"], {"rope_type": "linear"}),
        ("softmax", "rope", ["--rope-scaling=ntk", "--rope-factor=3"], {"rope_type": "ntk"}),
        ("lssar", "rope", ["--rope-scaling=dynamic-ntk"], {"rope_type": "dynamic"}),
    ],
)
def test_export_carries_the_positions_and_computes_the_same_logits(
    tmp_path, attn, pos, flags, written
):
    """ALiBi, NoPE and every RoPE scaling written into config.json (transformers' form for the
    scalings); the model loaded by transformers gives the lssar GPT's logits, also beyond the
    training length (32 tokens) and through HF's cache in generate."""
    from lssar.cli import main
    from lssar.train import load_run

    run = make_tiny_run(tmp_path, attn, pos, name=f"{attn}-{pos}")
    out = tmp_path / "hf"
    assert main(["export-hf", str(run), str(out), *flags]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pos"] == pos
    if "rope_type" in written:
        rp = cfg["rope_parameters"]
        assert rp["rope_type"] == written["rope_type"] and rp["rope_theta"] == 10000.0
        assert cfg["max_position_embeddings"] == 32
        assert rp.get("original_max_position_embeddings") == (32 if "yarn" in flags[0] else None)
    else:
        assert cfg.get("rope_parameters") is None
    gpt, tcfg, _ = load_run(run)
    kw = {k.removeprefix("--").replace("-", "_"): v for k, v in (f.split("=") for f in flags)}
    gpt.switch(**kw, train_len=tcfg.seq_len)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.gpt.rope_scaling == gpt.rope_scaling
    x = torch.randint(0, 256, (2, 80))
    torch.testing.assert_close(model(x).logits, gpt(x)[0], atol=1e-5, rtol=0)
    gen = model.generate(x[:, :20], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, gpt.generate(x[:, :20], 6, temperature=0))


def test_export_refuses_a_length_dependent_factor_and_rope_scaling_without_rope(tmp_path, capsys):
    from lssar.cli import main

    run = make_tiny_run(tmp_path, "softmax")
    assert main(["export-hf", str(run), str(tmp_path / "a"), "--rope-scaling=yarn"]) == 2
    assert "auto depends on the evaluated length" in capsys.readouterr().err
    alibi = make_tiny_run(tmp_path, "softmax", "alibi", name="alibi")
    argv = ["export-hf", str(alibi), str(tmp_path / "b"), "--rope-scaling=yarn", "--rope-factor=2"]
    assert main(argv) == 2
    assert "rescales RoPE; this model was trained with pos='alibi'" in capsys.readouterr().err


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


# what runs in a Python that cannot import lssar: `-I` (no checkout on the path, no user site) and
# a finder that refuses every lssar module, so the exported directory must stand alone
_NO_LSSAR = """
import importlib.abc, sys
from pathlib import Path

class NoLssar(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lssar" or name.startswith("lssar."):
            raise ModuleNotFoundError(f"No module named {name!r} (lssar is not installed here)")

sys.meta_path.insert(0, NoLssar())
import torch
from transformers import AutoModelForCausalLM

for d in map(Path, sys.argv[1:]):
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    x, mask = torch.load(d / "x.pt"), torch.load(d / "mask.pt")
    with torch.no_grad():
        out = {
            "logits": model(x).logits,
            "padded": model(x, attention_mask=mask).logits,
            "gen": model.generate(x[:, :20], max_new_tokens=6, do_sample=False, pad_token_id=0),
        }
    torch.save(out, d / "remote.pt")
loaded = sorted(m for m in sys.modules if m == "lssar" or m.startswith("lssar."))
assert not loaded, loaded
print("ok", len(sys.argv) - 1)
"""


def test_export_loads_with_trust_remote_code_without_lssar(tmp_path):
    """An exported directory carries auto_map and its modeling file: transformers loads it with
    trust_remote_code=True in a Python where lssar cannot be imported, and the model computes the
    lssar GPT's logits (a learned scale, ALiBi, NoPE, a RoPE scaling, re-weighting), on a padded
    batch too, and generates the same tokens."""
    import subprocess

    from lssar.cli import main
    from lssar.train import load_run

    cases = [
        ("lssar", "rope", []),
        ("ssmax", "rope", []),
        ("softmax-qknorm-logn", "alibi", []),
        ("lssa", "nope", []),
        ("softmax", "rope", ["--rope-scaling=yarn", "--rope-factor=4"]),
    ]
    dirs, expected = [], []
    for attn, pos, flags in cases:
        run = make_tiny_run(tmp_path / attn, attn, pos, name=f"{attn}-{pos}")
        out = tmp_path / f"hf-{attn}-{pos}"
        assert main(["export-hf", str(run), str(out), *flags]) == 0
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["auto_map"]["AutoModelForCausalLM"] == ("modeling_lssar_gpt.LssarGPTForCausalLM")
        assert cfg["lssar_variant"]["name"] == attn and (out / "modeling_lssar_gpt.py").is_file()
        gpt, tcfg, _ = load_run(run)
        kw = {k.removeprefix("--").replace("-", "_"): v for k, v in (f.split("=") for f in flags)}
        gpt.switch(**kw, train_len=tcfg.seq_len)
        x = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(x)
        mask[1, :5] = 0  # left padding
        torch.save(x, out / "x.pt")
        torch.save(mask, out / "mask.pt")
        with torch.no_grad():
            want = {
                "logits": gpt(x)[0],
                "gen": gpt.generate(x[:, :20], 6, temperature=0),
                "padded": hf.LssarGPTForCausalLM.from_gpt(gpt)(x, attention_mask=mask).logits,
            }
        dirs.append(out)
        expected.append(want)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    env.pop("PYTHONPATH", None)
    r = subprocess.run(
        [sys.executable, "-I", "-c", _NO_LSSAR, *map(str, dirs)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and r.stdout.startswith("ok 5"), r.stderr[-3000:]
    for (attn, pos, _), d, want in zip(cases, dirs, expected):
        got = torch.load(d / "remote.pt")
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=0, msg=attn)
        # the padded row's real tokens (lssar's own HF model on the same padded batch)
        torch.testing.assert_close(got["padded"], want["padded"], atol=1e-5, rtol=0, msg=attn)
        assert torch.equal(got["gen"], want["gen"]), (attn, pos)


def test_exported_model_dispatches_through_the_attention_interface(tiny_run, tmp_path):
    """With lssar's attention registered, the exported modeling file's model looks its attention
    up by name as stock models do: lssar's function for its variant (the default); a name for
    another rule is refused. (Where lssar is installed, the Auto classes pick lssar's own
    lssar-gpt class; the file's class is loaded here from the directory.)"""
    import importlib.util

    from transformers import AttentionInterface

    from lssar.cli import main
    from lssar.train import load_run

    out = tmp_path / "hf"
    assert main(["export-hf", str(tiny_run), str(out)]) == 0  # an lssa run
    hf.register()
    calls = []
    real = hf.attention_function("lssa")

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    AttentionInterface.register("lssa", spy)
    try:
        spec = importlib.util.spec_from_file_location("exported", out / "modeling_lssar_gpt.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.LssarGPTForCausalLM.from_pretrained(out).eval()
        x = torch.randint(0, 256, (2, 20))
        gpt = load_run(tiny_run)[0]
        torch.testing.assert_close(model(x).logits, gpt(x)[0], atol=1e-5, rtol=0)
        assert len(calls) == gpt.cfg.n_layer  # one call per layer, through the interface
        model.config._attn_implementation = "lssar"
        with pytest.raises(ValueError, match="this model computes 'lssa'"):
            model(x)
    finally:
        AttentionInterface.register("lssa", real)
