"""The learning-rate schedule of every training loop in the project: linear warmup, then cosine
decay to a floor.

One function of the step, so that a resumed run replays the exact learning rates of an
uninterrupted one without saving scheduler state (the step is the state). The language-model
loop (:func:`lssar.train.loop.lr_at`), the recall and orbits studies, passkey fine-tuning and a
fine-tuning loop for any ``nn.Module`` use it::

    for step in range(start, total):
        lr = warmup_cosine(step, total=total, peak=2e-5, warmup=100, floor=2e-6)
        set_lr(optimizer, lr)
        ...
"""

from __future__ import annotations

import math

import torch


def warmup_cosine(
    step: int,
    *,
    total: int,
    peak: float,
    warmup: int = 0,
    floor: float = 0.0,
    floor_ratio: float | None = None,
) -> float:
    """The learning rate of 0-based ``step`` of ``total``: ``peak * (step + 1) / warmup`` for the
    first ``warmup`` steps, then a cosine from ``peak`` down to the floor at ``step == total``
    (held there after it).

    The floor is given either absolutely (``floor``) or as a fraction of the peak
    (``floor_ratio``, e.g. 0.1). Both give the same curve; each is computed in the float order
    of the runs reported with it (the language-model loop states an absolute ``min_lr``; the
    recall, orbits and passkey loops a tenth of the peak), so those runs reproduce to the last
    bit.
    """
    if total < 1 or warmup < 0:
        raise ValueError(f"a schedule needs total >= 1 and warmup >= 0, got {total}, {warmup}")
    if floor_ratio is not None and floor != 0.0:
        raise ValueError("give the floor once: floor (absolute) or floor_ratio (of the peak)")
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    w = 0.5 * (1 + math.cos(math.pi * frac))  # 1 -> 0; halving is exact in binary
    if floor_ratio is None:
        return floor + w * (peak - floor)
    return peak * (floor_ratio + (1 - floor_ratio) * w)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr`` times its ``lr_scale`` (default 1:
    a group built with ``{"params": ..., "lr_scale": 10.0}`` trains ten times faster, e.g. new
    layers beside pretrained ones)."""
    for group in optimizer.param_groups:
        scale = group.get("lr_scale", 1.0)
        group["lr"] = lr if scale == 1.0 else lr * scale
