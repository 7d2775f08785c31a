"""Tests for lssar.train.schedule: the one warmup + cosine schedule of every training loop."""

from __future__ import annotations

import math

import pytest
import torch

from lssar.train.schedule import set_lr, warmup_cosine


def _lm_before(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """``lssar.train.loop.lr_at`` as it was written before the schedule had one home."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (lr - min_lr)


def _tenth_before(step: int, lr: float, warmup: int, total: int) -> float:
    """The recall study's and passkey's schedule as written before (orbits': 0.45 for 0.9 * 0.5,
    the same double)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@pytest.mark.parametrize(
    "lr, min_lr, warmup, total",
    [(3e-3, 3e-4, 50, 450), (6e-4, 6e-5, 700, 19073), (1e-3, 1e-4, 0, 100), (2e-5, 0.0, 7, 91)],
)
def test_absolute_floor_is_the_lm_loops_to_the_last_bit(lr, min_lr, warmup, total) -> None:
    got = [
        warmup_cosine(s, total=total, peak=lr, warmup=warmup, floor=min_lr)
        for s in range(total + 3)
    ]
    assert got == [_lm_before(s, lr, min_lr, warmup, total) for s in range(total + 3)]


@pytest.mark.parametrize(
    "lr, warmup, total", [(1e-3, 50, 1500), (3e-3, 60, 600), (1e-3, 80, 800), (7.3e-4, 0, 99)]
)
def test_floor_ratio_is_the_recall_orbits_and_passkey_loops_to_the_last_bit(lr, warmup, total):
    got = [
        warmup_cosine(s, total=total, peak=lr, warmup=warmup, floor_ratio=0.1) for s in range(total)
    ]
    assert got == [_tenth_before(s, lr, warmup, total) for s in range(total)]


def test_shape_warmup_peak_floor() -> None:
    lrs = [warmup_cosine(s, total=110, peak=1.0, warmup=10, floor=0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0 and max(lrs) == 1.0
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[60] == pytest.approx(0.55) and lrs[110:] == [pytest.approx(0.1)] * 10
    ratio = [warmup_cosine(s, total=110, peak=1.0, warmup=10, floor_ratio=0.1) for s in range(120)]
    assert ratio == pytest.approx(lrs, abs=1e-15)  # the same curve in another float order


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="total >= 1"):
        warmup_cosine(0, total=0, peak=1.0)
    with pytest.raises(ValueError, match="warmup >= 0"):
        warmup_cosine(0, total=5, peak=1.0, warmup=-1)
    with pytest.raises(ValueError, match="give the floor once"):
        warmup_cosine(0, total=5, peak=1.0, floor=0.1, floor_ratio=0.1)


def test_set_lr_scales_groups() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr_scale": 10.0}], lr=1.0)
    set_lr(opt, 3e-4)
    assert [g["lr"] for g in opt.param_groups] == [3e-4, pytest.approx(3e-3)]
