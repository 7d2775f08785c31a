"""Batches: training windows as a pure function of (seed, step, micro_step, rank), the
evaluation windows, and the documents inside a batch (:func:`eot_documents`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, ...]:
    win = torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], np.int64))
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if len(tokens) < seq_len + 1:
        need = f"{what} needs seq_len+1 = {seq_len + 1} tokens, the split has {len(tokens)}"
        raise ValueError(f"{need}: use a shorter seq_len or a larger corpus")


def get_batch(
    tokens: np.ndarray,
    step: int,
    micro_step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``(x, y)``, int64 ``(batch_size, seq_len)``, ``y`` = ``x`` shifted by one.

    The global batch is ``world_size * batch_size`` window starts drawn from
    ``default_rng([seed, step, micro_step])``; ``rank`` takes rows ``[rank*b, (rank+1)*b)``.
    No hidden state: the same arguments always give the same batch.
    """
    if batch_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size: {batch_size=} {rank=}")
    if min(seed, step, micro_step) < 0:
        raise ValueError(f"seed, step, micro_step must be >= 0, got {seed}, {step}, {micro_step}")
    _check_length(tokens, seq_len, "a training window")
    rng = np.random.default_rng([seed, step, micro_step])
    starts = rng.integers(0, len(tokens) - seq_len, size=world_size * batch_size)
    return _windows(tokens, starts[rank * batch_size : (rank + 1) * batch_size], seq_len)


def eval_starts(n_tokens: int, seq_len: int, max_tokens: int) -> np.ndarray:
    """Starts of ``min((n_tokens - 1) // seq_len, max_tokens // seq_len)`` non-overlapping
    windows of ``seq_len + 1`` tokens spread evenly over a split of ``n_tokens``: the first at 0,
    the last ending at the split's end, so every part of the split is sampled, not only its start.
    """
    n = min((n_tokens - 1) // seq_len, max_tokens // seq_len)
    if n <= 1:
        return np.zeros(n, dtype=np.int64)
    # spacing (n_tokens - 1 - seq_len) / (n - 1) >= seq_len because n * seq_len <= n_tokens - 1
    return np.arange(n, dtype=np.int64) * (n_tokens - 1 - seq_len) // (n - 1)


def iter_eval_windows(
    tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping ``(x, y)`` windows spread evenly over the split (:func:`eval_starts`).

    Yields batches of up to ``batch_size`` rows until ``max_tokens`` target tokens are covered
    (``max_tokens // seq_len`` windows, fewer if the split is shorter): a fixed budget of
    scored tokens at every length when ``max_tokens`` is a multiple of each ``seq_len``.
    """
    _check_length(tokens, seq_len, "evaluation")
    if max_tokens < seq_len or batch_size < 1:
        raise ValueError(f"need max_tokens >= seq_len, batch_size >= 1: {max_tokens=} {seq_len=}")
    starts = eval_starts(len(tokens), seq_len, max_tokens)
    for b in range(0, len(starts), batch_size):
        yield _windows(tokens, starts[b : b + batch_size], seq_len)


def eot_documents(x: torch.Tensor, eot: int) -> torch.Tensor:
    """The documents of a batch ``x (B, T)``, as ``cu_seqlens``: int64 ``(n_docs + 1,)``
    boundaries along the batch flattened into one row of ``B * T`` tokens (FlashAttention's
    varlen layout, what :meth:`lssar.model.GPT.forward` takes).

    A document starts at every row start and at every ``eot`` token: the EOT token *begins* the
    document after it. Shards put the separator before each document
    (:func:`lssar.data.prepare`), and ``lssar sample`` and ``lssar lm-eval`` start a document with
    it, so a document-masked model trains on ``[EOT, tokens...]`` with nothing before, as it is
    prompted; the previous document's last token still predicts the EOT (its target), from that
    document's context. (FlashAttention / transformers packing counts an EOS as the end of the
    document before it.)
    """
    b, t = x.shape
    starts = x == eot  # (B, T)
    starts[:, 0] = True
    first = starts.reshape(-1).nonzero().squeeze(1)  # (n_docs,) ascending
    return torch.cat([first, first.new_tensor([b * t])])
