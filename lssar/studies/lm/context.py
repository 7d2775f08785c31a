"""Does a model use the context it is given? Two measurements for any model with the GPT's
evaluation interface (``model(x, y, reduction="none", window=W) -> (_, loss (B, T))``: an lssar
GPT or a Hugging Face model through :class:`lssar.integrations.hf_lm.HFCausalLM`).

- :func:`loss_in_documents`: one forward over the first ``T_max`` tokens of each of ``n`` long
  held-out documents. Its per-position loss gives the loss at every shorter length for free
  (the model is causal: the first ``T`` positions of the long window *are* a length-``T``
  window starting at the document's start), so every length is scored on the same documents,
  paired. Beside the cumulative loss at each length it reports the loss of the positions in
  ``(T/2, T]`` (what a model adds, or loses, between one length and the next) and the loss by
  position in buckets.
- :func:`copy_probe`: a segment of real text, then ``d - seg`` tokens of other real text, then
  the same segment again. The loss on the second copy against the first shows whether the model
  reads back ``d`` tokens: a model that only sees its last ``L < d`` keys scores the second copy
  like the first. Distances run past the training length (``2L``, ``4L``, ...).

Run each with ``window=L`` too (each arm with its own training-length window) to see what the
keys beyond ``L`` are worth.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

N_BUCKETS = 32  # position buckets of the longest window
COPY_SEGMENT = 64  # tokens of the repeated segment


def long_documents(tokens: np.ndarray, eot: int | None, length: int, n: int) -> list[np.ndarray]:
    """The first ``length + 1`` tokens of the first ``n`` documents of a split (documents in the
    split's order, separated by ``eot``) that have at least that many; ``ValueError`` when the
    split has fewer."""
    if eot is None:
        raise ValueError("documents need a tokenizer with a document separator (eot)")
    tokens = np.asarray(tokens)
    cuts = np.flatnonzero(tokens == eot)
    starts = np.concatenate([[0], cuts + 1])
    ends = np.concatenate([cuts, [len(tokens)]])
    # a document is the separator's successor up to the next separator (the separator kept as
    # its first token where the split puts one before it: prepare() does)
    docs = [
        tokens[max(0, s - 1) : max(0, s - 1) + length + 1]
        for s, e in zip(starts, ends)
        if e - max(0, s - 1) >= length + 1
    ]
    if len(docs) < n:
        raise ValueError(
            f"the held-out split has {len(docs)} documents of at least {length + 1} tokens, "
            f"{n} are needed: lower the longest length or the number of documents, or prepare "
            "the data with a larger --val-fraction"
        )
    return docs[:n]


def _buckets(t: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, t, min(N_BUCKETS, t) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def _spans(window: int | None, sink_tokens: int) -> dict[str, Any]:
    """The model's visibility keywords: ``sink_tokens`` only when set (a model interface without
    sinks still takes the rest)."""
    return {"window": window} | ({"sink_tokens": sink_tokens} if sink_tokens else {})


@torch.inference_mode()
def loss_in_documents(
    model: Any,
    docs: list[np.ndarray],
    lengths: list[int],
    window: int | None = None,
    progress: bool = True,
    sink_tokens: int = 0,
) -> dict[str, Any]:
    """Loss by length and position from one forward per document (see the module docstring).

    Returns ``{"protocol": "documents", "documents", "tokens_per_length", "loss" {T: mean over
    the first T positions of every document}, "loss_band" {T: mean over positions (T/2, T]},
    "loss_by_document" {T: [per document]}, "band_by_document", "position_buckets",
    "loss_by_position"}`` (lengths as strings, as in :func:`lssar.studies.lm.evaluate`)."""
    t_max = max(lengths)
    per_pos = []
    for doc in tqdm(docs, desc="documents", disable=not progress, leave=False):
        if len(doc) < t_max + 1:
            raise ValueError(f"a document has {len(doc)} tokens, {t_max + 1} are needed")
        ids = torch.as_tensor(np.asarray(doc[: t_max + 1], dtype=np.int64))
        _, loss = model(
            ids[None, :-1], ids[None, 1:], reduction="none", **_spans(window, sink_tokens)
        )
        per_pos.append(loss[0].double().cpu().numpy())  # (T_max,)
    pos = np.stack(per_pos)  # (n, T_max)
    out: dict[str, Any] = {
        "protocol": "documents",
        "documents": len(docs),
        "tokens_per_length": {str(t): t * len(docs) for t in lengths},
        "loss": {},
        "loss_band": {},
        "loss_by_document": {},
        "band_by_document": {},
    }
    for t in lengths:
        whole, band = pos[:, :t].mean(1), pos[:, t // 2 : t].mean(1)
        out["loss"][str(t)] = float(whole.mean())
        out["loss_band"][str(t)] = float(band.mean())
        out["loss_by_document"][str(t)] = whole.tolist()
        out["band_by_document"][str(t)] = band.tolist()
    buckets = _buckets(t_max)
    out["position_buckets"] = [list(b) for b in buckets]
    out["loss_by_position"] = [float(pos[:, a:b].mean()) for a, b in buckets]
    return out


@torch.inference_mode()
def copy_probe(
    model: Any,
    tokens: np.ndarray,
    distances: list[int],
    n: int = 8,
    segment: int = COPY_SEGMENT,
    window: int | None = None,
    seed: int = 0,
    progress: bool = True,
    sink_tokens: int = 0,
) -> dict[str, Any]:
    """Loss on a repeated segment ``d`` tokens after its first occurrence (module docstring).

    ``n`` probes per distance, drawn from ``tokens`` (held-out text) by ``seed`` (the same probes
    for every model). Returns ``{"segment", "probes", "first" {d: loss on the first copy},
    "second" {d: loss on the second copy}, "second_by_probe" {d: [...]}}``; the first token of
    each copy is not scored (nothing announces it). With ``window`` and ``sink_tokens`` the second
    copy also sees the first ``sink_tokens`` tokens of the first (the row's start)."""
    tokens = np.asarray(tokens)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"segment": segment, "probes": n, "first": {}, "second": {}}
    out["second_by_probe"], out["first_by_probe"] = {}, {}
    for d in tqdm(distances, desc="copy probe", disable=not progress, leave=False):
        if d < segment:
            raise ValueError(f"copy distance {d} is shorter than the segment ({segment} tokens)")
        if len(tokens) < d + segment + 1:
            raise ValueError(f"copy distance {d} needs {d + segment + 1} held-out tokens")
        rows = []
        for _ in range(n):
            a = int(rng.integers(0, len(tokens) - segment))
            b = int(rng.integers(0, len(tokens) - (d - segment)))
            seg = tokens[a : a + segment]
            rows.append(np.concatenate([seg, tokens[b : b + d - segment], seg]))
        ids = torch.as_tensor(np.stack(rows).astype(np.int64))  # (n, d + segment)
        _, loss = model(ids[:, :-1], ids[:, 1:], reduction="none", **_spans(window, sink_tokens))
        # loss: (n, T-1)
        # target index j predicts token j + 1: copy 1 is tokens 1..seg-1, copy 2 is d+1..d+seg-1
        first = loss[:, : segment - 1].double().mean(1)
        second = loss[:, d : d + segment - 1].double().mean(1)
        out["first"][str(d)] = float(first.mean())
        out["second"][str(d)] = float(second.mean())
        out["first_by_probe"][str(d)] = first.tolist()
        out["second_by_probe"][str(d)] = second.tolist()
    return out
