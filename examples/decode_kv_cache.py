"""Decode with a KV cache: one query at a time against the cache, with ``lssar.attention``
directly and with the GPT's ``generate()``.

    python examples/decode_kv_cache.py                        # a 1,024-token cache
    python examples/decode_kv_cache.py --prompt 64 --steps 8  # toy size

A decode step is an ordinary call: the new query ``[B, H, 1, D]`` against the whole cache
``[B, H_kv, T_k, D]`` with ``is_causal=True``. The causal mask is bottom-right aligned, so the
step equals the last row of the full causal call, and N_i (LSSA's length scale) counts the cache.
"""

from __future__ import annotations

import argparse
import time

import torch

import lssar
from lssar.model import GPT, GPTConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024, help="tokens in the cache at the start")
    ap.add_argument("--steps", type=int, default=32, help="tokens to decode")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    B, H, H_kv, D = 1, 8, 2, 64  # grouped-query attention: 4 query heads per key/value head
    total = args.prompt + args.steps
    q = torch.randn(B, H, total, D)
    k, v = torch.randn(B, H_kv, total, D), torch.randn(B, H_kv, total, D)

    # 1. the attention alone: a cache that grows by one key and value per step
    cache_k, cache_v = k[:, :, : args.prompt], v[:, :, : args.prompt]
    with torch.no_grad():  # the first call loads the fused kernel: not part of a step's time
        lssar.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], is_causal=True, enable_gqa=True)
    steps = []
    t0 = time.perf_counter()
    for t in range(args.prompt, total):
        cache_k = torch.cat([cache_k, k[:, :, t : t + 1]], dim=2)
        cache_v = torch.cat([cache_v, v[:, :, t : t + 1]], dim=2)
        with torch.no_grad():  # no gradient to record: `auto` runs the fused decode entry on CPU
            out = lssar.attention(
                q[:, :, t : t + 1], cache_k, cache_v, is_causal=True, enable_gqa=True
            )
        steps.append(out)
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    full = lssar.attention(q, k, v, is_causal=True, enable_gqa=True)  # every row at once
    gap = (torch.cat(steps, dim=2) - full[:, :, args.prompt :]).abs().max().item()
    print(f"lssar p=15, {args.steps} steps after {args.prompt} keys: {ms:.2f} ms/step")
    print(f"max |step - full causal call| = {gap:.1e}")
    assert gap < 1e-4, gap

    # 2. the GPT: generate() keeps a KV cache that grows in place
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, attn="lssar", attn_options={"p": 15.0}))
    prompt = torch.randint(0, 256, (1, args.prompt))
    t0 = time.perf_counter()
    ids = model.generate(prompt, max_new_tokens=args.steps, temperature=0.0)  # greedy
    rate = args.steps / (time.perf_counter() - t0)
    print(f"GPT generate(): {ids.shape[1] - args.prompt} tokens at {rate:.0f} tokens/s")
    # greedy decoding with the cache picks what a full forward pass over the sequence picks
    with torch.no_grad():
        logits, _ = model(ids[:, :-1])
    assert torch.equal(logits[0, args.prompt - 1 :].argmax(-1), ids[0, args.prompt :])


if __name__ == "__main__":
    main()
