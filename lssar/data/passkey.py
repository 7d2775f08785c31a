"""Passkey probes: a key hidden in real text, then the question (evaluation and the lm-eval task).

One builder (:func:`passkey_probe`) serves ``lssar eval --passkey`` and the ``lssar_passkey``
lm-eval tasks, so both score the same probes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

KEY_TEMPLATE = " The pass key is {key}. Remember it. "
QUESTION = " What is the pass key? The pass key is "


def passkey_probe(
    tok,
    filler: Sequence[int] | np.ndarray,
    length: int,
    key: str,
    place: Callable[[int], tuple[int, int]],
    question: str = QUESTION,
    answer: str | None = None,
) -> tuple[list[int], list[int]]:
    """The one passkey probe builder (evaluation and the lm-eval task): (context ids, answer ids).

    ``n_fill`` filler tokens (real text) from ``filler[start:]`` with ``KEY_TEMPLATE`` inserted
    after ``cut`` of them, then ``question``; ``place(n_fill)`` chooses ``(start, cut)``. The
    context plus the answer (``answer``, default ``key``) is exactly ``length`` tokens.
    """
    key_ids = tok.encode(KEY_TEMPLATE.format(key=key))
    q_ids, ans = tok.encode(question), tok.encode(key if answer is None else answer)
    probe = len(key_ids) + len(q_ids) + len(ans)
    n_fill = length - probe
    if n_fill < 0:
        raise ValueError(
            f"length {length} is too short for a passkey probe: it does not fit the probe "
            f"({probe} tokens without filler)"
        )
    if n_fill >= len(filler):
        raise ValueError(f"passkey length {length} needs more filler text than the held-out text")
    start, cut = place(n_fill)
    fill = np.asarray(filler[start : start + n_fill]).tolist()
    return fill[:cut] + key_ids + fill[cut:] + q_ids, ans


def passkey_sample(
    tok, filler: np.ndarray, length: int, depth: float, key: str, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Token ids of one probe of exactly ``length`` tokens and where the answer starts.

    Filler text (real corpus tokens) surrounds ``KEY_TEMPLATE`` placed at relative ``depth``;
    the sequence ends with ``QUESTION`` followed by the key's tokens (the answer).
    """
    ids, answer, _ = passkey_sample_at(tok, filler, length, depth, key, rng)
    return ids, answer


def passkey_sample_at(
    tok, filler: np.ndarray, length: int, depth: float, key: str, rng: np.random.Generator
) -> tuple[list[int], int, int]:
    """:func:`passkey_sample` (the same probe from the same ``rng``) and where the key sits in
    it: the index just after the template's ``" The pass key is"``, the key's first token (or,
    for a byte tokenizer, the space before it). ``answer - key_at`` is how far back the answer
    must reach: the distance a study splits probes by (within / beyond the training length)."""
    cuts: list[int] = []

    def place(n_fill: int) -> tuple[int, int]:
        cuts.append(int(round(depth * n_fill)))
        return int(rng.integers(0, len(filler) - n_fill)), cuts[-1]

    context, ans = passkey_probe(tok, filler, length, key, place)
    lead = tok.encode(KEY_TEMPLATE.split("{key}")[0].rstrip())
    return context + ans, len(context), cuts[0] + len(lead)
