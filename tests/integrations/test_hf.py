"""Tests for lssar.integrations.hf: lssar attention in HF models (registration, masks, caches,
packed batches, sliding windows); the lssar-gpt model is in test_hf_gpt.py, export in
test_hf_export.py."""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DynamicCache,
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
from lssar.ops.variants import VARIANTS  # noqa: E402
from tests.integrations.hf_models import ATOL, FAMILIES, flattened, pad, ragged, tiny  # noqa: E402

MAIN = ("lssar", "lssa", "softmax")


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    hf.register()


pytestmark = pytest.mark.usefixtures("one_thread")


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
