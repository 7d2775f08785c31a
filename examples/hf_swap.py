"""Swap lssar's attention into a Hugging Face model: a Llama built from its config, once with
transformers' SDPA attention and once with LSSAR, and greedy generation with a KV cache.

    python examples/hf_swap.py                      # a 4-layer, 256-wide Llama
    python examples/hf_swap.py --layers 2 --width 64 --new-tokens 8   # toy size

Any causal LM that takes ``attn_implementation`` (Llama, Qwen2, Mistral, ...) works the same
way; a pretrained checkpoint loads with ``from_pretrained(path, attn_implementation="lssar")``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import lssar.hf


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    lssar.hf.register()  # every lssar variant name becomes an attn_implementation
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: lssar serves it without repeating K, V
        max_position_embeddings=4096,
        # lssar_p=3.0 here would set the re-weighting power of every lssar attention of the
        # model (the "lssar" variant's default is the paper's p = 15)
    )
    torch.manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, 16))
    weights = None
    for attn in ("sdpa", "softmax", "lssar"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        if weights is None:
            weights = model.state_dict()
        model.load_state_dict(weights)  # the same weights for every attention
        with torch.no_grad():
            out = model.generate(
                prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
            )
            logits = model(prompt).logits
        print(f"{attn:8} generated {out[0, prompt.shape[1] :].tolist()}")
        if attn == "sdpa":
            reference = logits
        elif attn == "softmax":  # lssar's softmax is transformers' SDPA attention
            gap = (logits - reference).abs().max().item()
            print(f"{'':8} max |logits - sdpa's| = {gap:.2e}")
            assert gap < 1e-4, gap


if __name__ == "__main__":
    main()
