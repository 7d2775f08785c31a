"""The associative-recall study: generator invariants, bad input, end-to-end, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lssar.recall.task import BOS, IGNORE, QUERY, RecallTask

TASK = RecallTask(train_len=64, n_pairs=6, n_queries=4, n_keys=16, n_values=16, n_filler=8)


@pytest.mark.parametrize("length", [64, 128, 256, 1024])
def test_generator_invariants(length):
    b = TASK.batch(seed=(3, length), length=length, size=20)
    tok, tgt = b["tokens"].numpy(), b["targets"].numpy()
    assert tok.shape == (20, length) and tgt.shape == (20, length)  # lengths exact
    assert tok.min() >= 0 and tok.max() < TASK.vocab_size
    is_key = (tok >= TASK.key0) & (tok < TASK.value0)
    for s in range(20):
        t = tok[s]
        assert t[0] == BOS
        m = TASK.n_queries
        ctx = t[: length - 3 * m]
        keys = ctx[is_key[s, : length - 3 * m]]
        assert len(keys) == TASK.n_pairs and len(set(keys.tolist())) == TASK.n_pairs  # no reuse
        pairs = {int(ctx[i]): int(ctx[i + 1]) for i in np.flatnonzero(is_key[s, : len(ctx)])}
        assert len(set(pairs.values())) == TASK.n_pairs  # pairs distinct
        assert all(TASK.value0 <= v < TASK.filler0 for v in pairs.values())
        block = t[length - 3 * m :].reshape(m, 3)
        assert (block[:, 0] == QUERY).all()
        assert len(set(block[:, 1].tolist())) == m
        qp, kp = b["query_pos"][s].numpy(), b["key_pos"][s].numpy()
        for j in range(m):
            k = t[qp[j]]
            assert t[kp[j]] == k and pairs[int(k)] == b["answer"][s, j]  # answers correct
            assert tgt[s, qp[j]] == pairs[int(k)] == t[qp[j] + 1]
            assert b["distance"][s, j] == qp[j] - kp[j] > 0
        assert (tgt[s] != IGNORE).sum() == m
    d = b["distance"].numpy()
    if length == TASK.train_len:
        assert (d < TASK.train_len).all()
    else:  # stratified: the first ceil(m/2) queries within train_len, the rest beyond
        assert (d[:, :2] < TASK.train_len).all() and (d[:, 2:] >= TASK.train_len).all()


def test_generator_deterministic_from_seed():
    a, b = TASK.batch(7, 128, 8), TASK.batch(7, 128, 8)
    c = TASK.batch(8, 128, 8)
    for k in a:
        assert torch.equal(a[k], b[k])
    assert not torch.equal(a["tokens"], c["tokens"])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(train_len=0), "train_len"),
        (dict(train_len=-5), "train_len"),
        (dict(n_pairs=40, n_keys=32), "n_pairs"),
        (dict(n_queries=9, n_pairs=8), "n_queries"),
        (dict(train_len=20, n_pairs=8, n_queries=4), "train_len"),
    ],
)
def test_bad_task(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RecallTask(**kwargs)


def test_bad_length():
    with pytest.raises(ValueError, match="length"):
        TASK.batch(0, 0, 2)
    with pytest.raises(ValueError, match="too short"):
        TASK.batch(0, TASK.min_length() - 1, 2)
