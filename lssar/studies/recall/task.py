"""Multi-query associative recall: a deterministic, seeded sequence generator.

Vocabulary (ids, in this order)::

    0            BOS     start of every sequence
    1            QUERY   marker before each query
    2 ..         keys    ``n_keys`` of them
    ..           values  ``n_values``
    ..           filler  ``n_filler`` distractor tokens

A sequence of exactly ``length`` tokens is::

    BOS  f f k1 v1 f f f k2 v2 f ... f  |  QUERY ka va  QUERY kb vb ...  (m queries)
         <------------ context ------->    <-------- 3 m tokens ------->

``n`` distinct keys, each with its own (distinct) value, sit as adjacent ``key value`` pairs
(``pair_order="kv"``, the default; ``"vk"`` stores them as ``value key``) at random
positions in uniform random filler; the last ``3 m`` tokens ask ``m`` distinct keys of
those pairs. The model is scored only where it must emit a value: at the position of each
queried key its next-token prediction must be the paired value (``targets`` is ``IGNORE``
everywhere else). No key appears twice in the context; the query block repeats the queried keys.

The key->query *distance* of a query is ``query_key_pos - context_key_pos``. A query is
``within`` when the distance is ``< train_len`` (both tokens fit in one training-length window,
the only distances training ever shows) and ``beyond`` otherwise.

Placement. At the training length every pair is placed uniformly. At a longer ``length`` (an
evaluation sequence) the *queried* pairs are stratified so both buckets are measured at every
length: the first ``ceil(m / 2)`` queried keys are placed within ``train_len`` of the query
block, the rest beyond it (uniformly inside each region); unqueried pairs are uniform over the
whole context. So "all" at 2x..16x is an equal mix of the two buckets, not a uniform placement.

Pair order. With ``kv`` the answering attention must match the query key against the *previous
token* of each value; with ``vk`` it matches the key token itself and reads the value before it.
Either way the model needs the previous token at a position: a plain 2-layer GPT has to build a
previous-token head first, and in the pilot (``reports/recall-*/PILOT.md``) it never did within
the CPU budget, so the study's model gets it from a token shift (``lssar/recall/model.py``).

Everything is a function of ``(seed, index)``: the same seed gives the same batch on every
machine, so runs resume exactly and every arm is scored on the same sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BOS, QUERY = 0, 1
IGNORE = -100


@dataclass(frozen=True)
class RecallTask:
    """The task's shape; :meth:`batch` draws sequences from it."""

    train_len: int = 64
    n_pairs: int = 8
    n_queries: int = 4
    n_keys: int = 32
    n_values: int = 32
    n_filler: int = 16
    pair_order: str = "kv"  # "kv": key then value; "vk": value then key (see the docstring)

    def __post_init__(self) -> None:
        if self.pair_order not in ("kv", "vk"):
            raise ValueError(f"pair_order={self.pair_order!r}: use 'kv' or 'vk'")
        for name in ("train_len", "n_pairs", "n_queries", "n_keys", "n_values", "n_filler"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.n_pairs > self.n_keys:
            raise ValueError(
                f"n_pairs={self.n_pairs} is larger than the number of keys n_keys={self.n_keys}"
            )
        if self.n_pairs > self.n_values:
            raise ValueError(
                f"n_pairs={self.n_pairs} is larger than the number of values "
                f"n_values={self.n_values} (values are distinct within a sequence)"
            )
        if self.n_queries > self.n_pairs:
            raise ValueError(f"n_queries={self.n_queries} must be <= n_pairs={self.n_pairs}")
        self.check_length(self.train_len, "train_len")

    # --- vocabulary
    @property
    def key0(self) -> int:
        return 2

    @property
    def value0(self) -> int:
        return 2 + self.n_keys

    @property
    def filler0(self) -> int:
        return 2 + self.n_keys + self.n_values

    @property
    def vocab_size(self) -> int:
        return 2 + self.n_keys + self.n_values + self.n_filler

    def min_length(self) -> int:
        """Shortest sequence holding BOS, n pairs and m queries."""
        return 1 + 2 * self.n_pairs + 3 * self.n_queries

    def check_length(self, length: int, name: str = "length") -> None:
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"{name}={length!r} must be a positive integer")
        if length < self.min_length():
            raise ValueError(
                f"{name}={length} is too short for n_pairs={self.n_pairs} and "
                f"n_queries={self.n_queries}: needs >= {self.min_length()} tokens"
            )

    # --- sampling
    def sequence(self, rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
        """One sequence: ``tokens``, ``targets`` (IGNORE except at query keys), and per query
        ``query_pos`` (position of the queried key in the query block), ``key_pos`` (its
        position in the context), ``answer`` (value id) and ``distance``."""
        self.check_length(length)
        n, m = self.n_pairs, self.n_queries
        ctx_end = length - 3 * m  # context is positions 1 .. ctx_end-1
        tokens = np.empty(length, dtype=np.int64)
        tokens[0] = BOS
        tokens[1:ctx_end] = self.filler0 + rng.integers(0, self.n_filler, ctx_end - 1)
        keys = self.key0 + rng.choice(self.n_keys, n, replace=False)
        values = self.value0 + rng.choice(self.n_values, n, replace=False)
        queried = rng.choice(n, m, replace=False)  # pair indices, in query order
        query_pos = ctx_end + 1 + 3 * np.arange(m)  # positions of the queried key tokens
        free = np.zeros(length, dtype=bool)
        free[1:ctx_end] = True
        starts = np.arange(length - 1)
        key_pos = np.full(n, -1, dtype=np.int64)
        stratify = length > self.train_len
        n_within = math.ceil(m / 2)
        order = list(queried) + [i for i in range(n) if i not in set(queried.tolist())]
        off = 0 if self.pair_order == "kv" else 1  # key's offset inside its pair
        for rank, i in enumerate(order):
            ok = free[:-1] & free[1:]
            if stratify and rank < m:
                q = query_pos[rank]
                d = q - (starts + off)
                # within: the key sits < train_len before its query; beyond: >= train_len
                ok &= (d < self.train_len) if rank < n_within else (d >= self.train_len)
            cand = np.flatnonzero(ok)
            if len(cand) == 0:  # only reachable for lengths barely above min_length
                raise ValueError(
                    f"length={length} leaves no room to place {n} pairs "
                    f"(train_len={self.train_len}, n_queries={m})"
                )
            s = int(rng.choice(cand))
            free[s : s + 2] = False
            key_pos[i] = s + off
            tokens[s + off], tokens[s + 1 - off] = keys[i], values[i]
        for j, i in enumerate(queried):
            p = query_pos[j]
            tokens[p - 1], tokens[p], tokens[p + 1] = QUERY, keys[i], values[i]
        targets = np.full(length, IGNORE, dtype=np.int64)
        targets[query_pos] = values[queried]
        kp = key_pos[queried]
        return {
            "tokens": tokens,
            "targets": targets,
            "query_pos": query_pos,
            "key_pos": kp,
            "answer": values[queried],
            "distance": query_pos - kp,
        }

    def batch(self, seed: int | tuple[int, ...], length: int, size: int) -> dict[str, torch.Tensor]:
        """``size`` sequences of ``length`` tokens from ``np.random.default_rng(seed)``.

        ``tokens``/``targets`` are ``(size, length)``; ``query_pos``, ``key_pos``, ``answer``,
        ``distance`` are ``(size, m)``.
        """
        if size < 1:
            raise ValueError(f"size={size} must be positive")
        self.check_length(length)
        rng = np.random.default_rng(seed)
        seqs = [self.sequence(rng, length) for _ in range(size)]
        return {k: torch.from_numpy(np.stack([s[k] for s in seqs])) for k in seqs[0]}
