"""Batches: training windows as a pure function of (seed, step, micro_step, rank), and the
evaluation windows."""

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


def iter_eval_windows(
    tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Contiguous non-overlapping ``(x, y)`` windows from the start of the split.

    Yields batches of up to ``batch_size`` rows until ``max_tokens`` target tokens are covered
    (``max_tokens // seq_len`` windows, fewer if the split is shorter): a fixed budget of
    scored tokens at every length when ``max_tokens`` is a multiple of each ``seq_len``.
    """
    _check_length(tokens, seq_len, "evaluation")
    if max_tokens < seq_len or batch_size < 1:
        raise ValueError(f"need max_tokens >= seq_len, batch_size >= 1: {max_tokens=} {seq_len=}")
    n_windows = min((len(tokens) - 1) // seq_len, max_tokens // seq_len)
    for b in range(0, n_windows, batch_size):
        yield _windows(tokens, np.arange(b, min(b + batch_size, n_windows)) * seq_len, seq_len)
