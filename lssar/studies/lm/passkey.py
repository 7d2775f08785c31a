"""Passkey retrieval for ``lssar eval --passkey`` and ``lssar reproduce``: fine-tune, then probe.

Every arm gets the same fine-tuning budget (:class:`PasskeySettings`: ``steps`` steps, linear
warmup then cosine decay, no early stop), so no arm's number depends on when a noisy check
happened to pass; whether it learned the task is read afterwards, from its accuracy at the
training length (an arm below ``target`` there is *inconclusive*, not a result). Probes put the
key at depths 10% / 50% / 90% of the context, and each probe also records how far back the key
sits from the answer (:func:`lssar.data.passkey.passkey_sample_at`), so accuracy is split by
distance as the recall study splits it: *within* (the key at most the training length back: a
model, or a sliding window of that length, has seen such distances) and *beyond*.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lssar.data.passkey import passkey_sample_at
from lssar.model import GPT
from lssar.train.schedule import set_lr, warmup_cosine

PASSKEY_DEPTHS = (0.1, 0.5, 0.9)


@dataclasses.dataclass(frozen=True)
class PasskeySettings:
    """How passkey is trained and scored: ``steps`` fine-tuning steps at the training length for
    every arm (``warmup_steps`` of linear warmup to ``lr``, then cosine to ``lr / 10``), then
    ``trials`` probes per (length, depth); keys of ``digits`` digits. ``target`` is the accuracy
    at the training length below which an arm did not learn the task (*inconclusive*)."""

    steps: int = 300
    warmup_steps: int = 30
    target: float = 0.9
    lr: float = 1e-3
    batch_size: int = 16
    digits: int = 5
    trials: int = 10

    def __post_init__(self) -> None:
        if self.steps < 1 or not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"passkey needs steps >= 1 and 0 <= warmup_steps <= steps, got steps="
                f"{self.steps}, warmup_steps={self.warmup_steps}"
            )
        if self.digits < 1:
            raise ValueError(f"passkey digits must be >= 1, got {self.digits}")

    @property
    def chance(self) -> float:
        """Guessing the key: its first digit is 1-9, the others 0-9 (:func:`_passkey_batch`)."""
        return 1.0 / (9 * 10 ** (self.digits - 1))

    def lr_at(self, step: int) -> float:
        """The learning rate of fine-tuning step ``step`` (0-based)."""
        return warmup_cosine(
            step, total=self.steps, peak=self.lr, warmup=self.warmup_steps, floor_ratio=0.1
        )


def _passkey_batch(tok, filler, length, n, rng, depth=None, digits=5):
    """``n`` probes: ids ``(n, length)``, where each answer starts and where each key sits."""
    seqs, starts, keys = [], [], []
    for _ in range(n):
        key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
        d = float(rng.uniform(0, 1)) if depth is None else depth
        ids, a, at = passkey_sample_at(tok, filler, length, d, key, rng)
        seqs.append(ids)
        starts.append(a)
        keys.append(at)
    return torch.tensor(seqs, dtype=torch.long), starts, keys


def passkey_finetune(
    model: GPT,
    tok,
    filler: np.ndarray,
    length: int,
    settings: PasskeySettings = PasskeySettings(),
    check_trials: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> tuple[GPT, dict[str, Any]]:
    """Fine-tune a copy of ``model`` on passkey probes at ``length`` for ``settings.steps``
    steps (the same for every arm: no early stop).

    The loss is on the answer tokens only; keys (``settings.digits`` digits) and depths are
    random. After the last step, greedy accuracy on ``check_trials`` fresh probes per depth of
    ``filler`` (the training text, never the test text) is recorded. Returns the tuned model and
    ``{"steps", "check_accuracy", "reached"}`` (``reached``: that accuracy is at least
    ``settings.target``).
    """
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    for step in tqdm(range(settings.steps), desc="passkey fine-tune", disable=not progress):
        set_lr(opt, settings.lr_at(step))
        x, starts, _ = _passkey_batch(
            tok, filler, length, settings.batch_size, rng, digits=settings.digits
        )
        logits, _ = model(x[:, :-1])
        mask = torch.zeros_like(x[:, 1:], dtype=torch.bool)
        for i, a in enumerate(starts):
            mask[i, a - 1 :] = True
        loss = F.cross_entropy(logits.float()[mask], x[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    grid = passkey_scores(
        model,
        tok,
        filler,
        [length],
        list(PASSKEY_DEPTHS),
        check_trials,
        seed + settings.steps,
        digits=settings.digits,
    )["accuracy"]
    acc = float(np.mean(list(grid[str(length)].values())))
    return model, {
        "steps": settings.steps,
        "check_accuracy": acc,
        "reached": acc >= settings.target,
    }


@torch.inference_mode()
def passkey_scores(
    model: GPT,
    tok,
    filler: np.ndarray,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int = 1,
    digits: int = 5,
    window: int | None = None,
    train_len: int | None = None,
) -> dict[str, Any]:
    """Greedy exact-match accuracy of the key per length and depth (``trials`` probes each):
    ``{"accuracy": {length: {depth: acc}}, "by_distance": {length: {"within" | "beyond":
    {"hits", "n"}}}}``. A probe is *within* when its key sits at most ``train_len`` tokens
    before the answer (default: the shortest length), else *beyond*. ``window`` limits every
    query to its last ``window`` keys (the sliding-window control)."""
    rng = np.random.default_rng(seed)
    limit = min(lengths) if train_len is None else train_len
    acc: dict[str, dict[str, float]] = {}
    split: dict[str, dict[str, dict[str, int]]] = {}
    for t in lengths:
        acc[str(t)] = {}
        split[str(t)] = {b: {"hits": 0, "n": 0} for b in ("within", "beyond")}
        for d in depths:
            x, starts, keys = _passkey_batch(tok, filler, t, trials, rng, depth=d, digits=digits)
            hits = 0
            for i in range(trials):  # one probe per forward keeps memory flat at long lengths
                logits, _ = model(x[i : i + 1, :-1], window=window)
                pred = logits[0, starts[i] - 1 :].argmax(-1)
                hit = bool(torch.equal(pred, x[i, starts[i] :]))
                hits += hit
                bucket = split[str(t)]["within" if starts[i] - keys[i] <= limit else "beyond"]
                bucket["hits"] += hit
                bucket["n"] += 1
            acc[str(t)][f"{d:g}"] = hits / trials
    return {"accuracy": acc, "by_distance": split}
