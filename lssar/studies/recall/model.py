"""The recall study's model: :class:`lssar.model.GPT` with a token shift at its input.

Why the shift. Retrieving ``v`` for a query ``k`` from a context ``... k v ...`` needs, at the
value's position, the identity of the token before it. A plain GPT has to learn that with a
previous-token attention head in its first layer, and the answer head in the second layer only
gets a signal once that head exists (the induction-head plateau). On 2 CPU cores the 2-layer GPT
stayed on that plateau (chance, or answering by elimination) for up to 2,500 steps in every
setting the pilot tried (``reports/recall-*/PILOT.md``), so no arm could be scored. With a token
shift (each position's input is its token's embedding plus a second embedding of the token before
it, as RWKV's token shift or the short convolutions of H3/Based/Mamba) the same GPT learns the
task in a few hundred steps, and the *retrieval* -- the one thing the study compares -- is done
by attention alone: the query must find, among all positions, the one whose previous token is its
key. The shift is local (one token back), so it cannot carry anything across the distances the
study measures.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lssar.model import GPT, GPTConfig

# The window control keeps the first token (BOS) visible besides the window. The sink is a project
# choice (StreamingLLM's attention sink): every training row saw BOS, and hiding it breaks the
# model at every distance, which would make the control fail for a reason unrelated to locality.
WINDOW_SINK_TOKENS = 1


class RecallModel(nn.Module):
    """``forward(idx (B, T), attn_mask=None, weights=None, window=None) -> (logits (B, T, V),
    None)``; ``window``: every query sees its last ``window`` keys and the first token
    (:data:`WINDOW_SINK_TOKENS`), by :func:`lssar.attention`'s ``window`` (memory O(T W)).

    ``gpt`` is an ordinary :class:`GPT` (its attention rule is switched with
    :meth:`set_attention`); ``prev`` (None without the shift) embeds the previous token, which is
    added to every position's input embedding (position 0 gets nothing).
    """

    def __init__(self, cfg: GPTConfig, token_shift: bool = True) -> None:
        super().__init__()
        self.gpt = GPT(cfg)
        self.prev = nn.Embedding(cfg.vocab_size, cfg.n_embd) if token_shift else None
        if self.prev is not None:
            nn.init.normal_(self.prev.weight, 0.0, 0.02)  # as GPT's own embedding

    @property
    def cfg(self) -> GPTConfig:
        return self.gpt.cfg

    def set_attention(self, attn: str, options: dict | None = None) -> None:
        """Switch every layer's attention rule (evaluation with re-weighting)."""
        self.gpt.set_attention(attn, options)

    def forward(
        self,
        idx: Tensor,
        attn_mask: Tensor | None = None,
        weights: list | None = None,
        window: int | None = None,
    ) -> tuple[Tensor, None]:
        sinks = 0 if window is None else WINDOW_SINK_TOKENS
        if self.prev is None:
            logits, _ = self.gpt(
                idx, attn_mask=attn_mask, weights=weights, window=window, sink_tokens=sinks
            )
            return logits, None
        if idx.min() < 0 or idx.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        h = self.gpt.wte(idx)  # (B, T, C)
        p = self.prev(idx[:, :-1])  # (B, T-1, C): the token before positions 1..T-1
        h = h + torch.cat([torch.zeros_like(h[:, :1]), p], dim=1)
        h = self.gpt.body(h, weights=weights, attn_mask=attn_mask, window=window, sink_tokens=sinks)
        return self.gpt.head(h), None
